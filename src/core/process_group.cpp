// The backend-independent half of every collective: argument checks, staging
// of non-contiguous tensors, numbering, and (DTRAIN_DEBUG=DETAIL) the
// cross-rank fingerprint. Backends only ever see validated calls.

#include "dtrain/process_group.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstring>
#include <limits>
#include <numeric>

#include "common/enforce.h"
#include "common/json_text.h"
#include "common/logging.h"
#include "diagnostics/fingerprint.h"
#include "diagnostics/flight_recorder.h"
#include "diagnostics/op_label.h"
#include "diagnostics/timeline.h"
#include "core/blocking_call.h"
#include "core/internal_tags.h"
#include "core/tensor_checks.h"

namespace dtrain {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: return "SUM";
    case ReduceOp::AVG: return "AVG";
    case ReduceOp::PRODUCT: return "PRODUCT";
    case ReduceOp::MIN: return "MIN";
    case ReduceOp::MAX: return "MAX";
    case ReduceOp::BAND: return "BAND";
    case ReduceOp::BOR: return "BOR";
    case ReduceOp::BXOR: return "BXOR";
    case ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
  }
  return "?";
}

ProcessGroup::ProcessGroup(int rank, int size, GroupOptions options)
    : rank_(rank), size_(size), options_(std::move(options)) {
  DTRAIN_CHECK_ARG(size > 0, "group '", options_.name(), "': size must be positive, got ", size);
  DTRAIN_CHECK_ARG(rank >= -1 && rank < size, "group '", options_.name(), "': rank ", rank,
                   " is out of range for size ", size);
  global_ranks_ = options_.global_ranks();
  if (global_ranks_.empty()) {
    global_ranks_.resize(size);
    std::iota(global_ranks_.begin(), global_ranks_.end(), 0);
  }
  DTRAIN_CHECK_ARG(static_cast<int>(global_ranks_.size()) == size, "group '", options_.name(),
                   "': ", global_ranks_.size(), " global ranks given for size ", size);
  check_collectives_ = options_.check_collectives().value_or(debug_level() == DebugLevel::Detail);
}

int ProcessGroup::group_rank_of(int global_rank) const {
  auto it = std::find(global_ranks_.begin(), global_ranks_.end(), global_rank);
  return it == global_ranks_.end() ? -1 : static_cast<int>(it - global_ranks_.begin());
}

void ProcessGroup::check_member(const char* op) const {
  if (rank_ >= 0) return;
  throw InvalidArgument(detail::cat(op, ": this rank is not a member of group '", name(),
                                    "' (global ranks ", detail::join(global_ranks_), ")"));
}

ProcessGroup::Call ProcessGroup::next_call(const char* op, Timeout timeout, bool collective) {
  auto t = timeout.value_or(options_.timeout());
  DTRAIN_CHECK_ARG(t.count() > 0, op, ": timeout must be positive, got ", t.count(), " ms");
  uint64_t seq = collective ? next_seq_++ : next_p2p_++;
  if (call_suffix_.empty())
    call_suffix_ = detail::cat(" on group '", name(), "' (rank ", rank_, "/", size_, ", backend ",
                               backend_name(), ")");
  // Built for every call: one allocation of the right size, no stream.
  char number[24];
  const auto end = std::to_chars(number, number + sizeof(number), seq).ptr;
  const size_t op_len = std::strlen(op);
  std::string description;
  description.reserve(op_len + 2 + static_cast<size_t>(end - number) + call_suffix_.size());
  description.append(op, op_len).append(" #").append(number, end).append(call_suffix_);
  return Call{op, seq, t, std::move(description), collective};
}

uint64_t ProcessGroup::record(const Call& call, const at::Tensor& tensor, int64_t root,
                              int64_t reduce_op) {
  if (!recorder_made_) {  // here, not in the constructor: backend_name() is virtual
    recorder_ = detail::FlightRecorder::create(
        detail::RecordedGroup{name(), rank(), size(), global_ranks(), backend_name()});
    recorder_made_ = true;
  }
  if (!recorder_) return 0;
  return recorder_->issued(call.op, call.collective, call.seq, tensor, root, reduce_op);
}

WorkPtr ProcessGroup::tracked(uint64_t id, const Call& call, WorkPtr work) {
  if (recorder_ && id != 0)
    work->on_finish([recorder = recorder_, id](const std::exception_ptr& error) {
      recorder->finished(id, error);
    });
  if (detail::timeline::enabled()) timeline_span(call, *work);
  return work;
}

void ProcessGroup::timeline_span(const Call& call, Work& work) {
  namespace tl = detail::timeline;
  struct Track {
    int id;
    std::mutex mutex;
    tl::Clock::time_point last_end;
  };
  if (!timeline_track_) {
    static std::atomic<int> next_id{0};
    auto track = std::make_shared<Track>();
    track->id = tl::kCollectiveTrack + next_id++;
    tl::name_track(track->id, "group '" + name() + "' (" + backend_name() + ")");
    timeline_track_ = track;
  }
  // A group runs its operations one after another: each is drawn from when
  // it was issued or the previous one ended, whichever is later, to its end.
  const auto issued = tl::Clock::now();
  work.on_finish([track = std::static_pointer_cast<Track>(timeline_track_), issued,
                  name = std::string(call.op), seq = call.seq, collective = call.collective,
                  label = detail::OpLabel::current()](const std::exception_ptr& error) {
    std::lock_guard<std::mutex> lock(track->mutex);
    const auto end = tl::Clock::now();
    const auto begin = std::max(issued, track->last_end);
    track->last_end = end;
    tl::span(name, track->id, begin, end,
             detail::cat("\"seq\": ", seq, ", \"kind\": \"", collective ? "collective" : "p2p",
                         "\", \"ok\": ", error ? "false" : "true",
                         label.empty() ? ""
                                       : ", \"label\": \"" + detail::json_escaped(label) + "\""));
  });
}

uint64_t ProcessGroup::begin(const Call& call, const at::Tensor& tensor, int64_t root,
                             int64_t reduce_op) {
  const auto id = record(call, tensor, root, reduce_op);
  try {
    fingerprint(call, tensor, root, reduce_op);
  } catch (...) {
    if (recorder_ && id != 0) recorder_->finished(id, std::current_exception());
    throw;
  }
  return id;
}

void ProcessGroup::fingerprint(const Call& call, const at::Tensor& tensor, int64_t root,
                               int64_t reduce_op) {
  if (!check_collectives_ || size_ == 1) return;
  auto mine = make_fingerprint(call.op, call.seq, tensor, root, reduce_op).to(control_device());
  std::vector<at::Tensor> rows;
  for (int i = 0; i < size_; ++i) rows.push_back(at::empty_like(mine));
  Call check{"fingerprint", call.seq, call.timeout, "fingerprint of " + call.description};
  Op gather;
  gather.type = OpType::ALL_GATHER;
  gather.inputs = {mine};
  gather.outputs = rows;
  dispatch(check, std::move(gather))->wait();
  for (auto& row : rows) row = row.cpu();
  compare_fingerprints(name(), call.seq, rows);
}

namespace {

// The staging copy of a non-contiguous output is written back once the
// operation has succeeded.
at::Tensor stage_output(const at::Tensor& t, std::vector<std::pair<at::Tensor, at::Tensor>>& back) {
  if (t.is_contiguous()) return t;
  auto staged = t.contiguous();
  back.emplace_back(t, staged);
  return staged;
}

// Whether every tensor of `op` is in host memory.
bool on_cpu(const Op& op) {
  for (const auto* list : {&op.inputs, &op.outputs})
    for (const auto& t : *list)
      if (t.defined() && !t.is_cpu()) return false;
  return true;
}

WorkPtr write_back(WorkPtr work, std::vector<std::pair<at::Tensor, at::Tensor>> back) {
  if (!back.empty() && work->on_device()) {
    // Device work: the copies are queued on the caller's stream behind the
    // work's end, so what the caller queues next sees them. A work that has
    // already failed keeps its error for the caller's wait().
    try {
      work->wait();
    } catch (const Error&) {
      return work;
    }
    for (const auto& [orig, staged] : back) orig.copy_(staged);
  } else if (!back.empty()) {
    work->on_success([back = std::move(back)] {
      for (const auto& [orig, staged] : back) orig.copy_(staged);
    });
  }
  return work;
}

}  // namespace

namespace {

Op make_op(OpType type, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
           int root = -1, ReduceOp reduce_op = ReduceOp::SUM) {
  Op op;
  op.type = type;
  op.inputs = std::move(inputs);
  op.outputs = std::move(outputs);
  op.root = root;
  op.reduce_op = reduce_op;
  return op;
}

bool reduces(OpType type) {
  return type == OpType::ALL_REDUCE || type == OpType::REDUCE || type == OpType::REDUCE_SCATTER ||
         type == OpType::REDUCE_SCATTER_TENSOR;
}

bool rooted(OpType type) {
  return type == OpType::BROADCAST || type == OpType::REDUCE || type == OpType::GATHER ||
         type == OpType::SCATTER;
}

// The tensor that the flight recorder and the fingerprint describe.
at::Tensor subject(const Op& op) {
  switch (op.type) {
    case OpType::ALL_GATHER:
    case OpType::GATHER:
    case OpType::ALL_GATHER_INTO_TENSOR:
    case OpType::SEND:
      return op.inputs[0];
    case OpType::ALL_TO_ALL:  // peers may send different sizes: dtype only
      return op.inputs[0].flatten().narrow(0, 0, 0);
    case OpType::BARRIER:
    case OpType::MONITORED_BARRIER:
      return at::Tensor();
    default:
      return op.outputs[0];
  }
}

// A descriptor's lists: how many tensors each holds, else an InvalidArgument.
void check_counts(const char* name, const Op& op) {
  size_t ins = 1, outs = 1;
  switch (op.type) {
    case OpType::ALL_REDUCE: case OpType::BROADCAST: case OpType::REDUCE: case OpType::RECV:
      ins = 0; break;
    case OpType::SEND: outs = 0; break;
    case OpType::BARRIER: case OpType::MONITORED_BARRIER: ins = outs = 0; break;
    default: return;  // lists: checked against the group's size
  }
  DTRAIN_CHECK_ARG(op.inputs.size() == ins && op.outputs.size() == outs, name,
                   ": a descriptor of this operation holds ", ins, " input(s) and ", outs,
                   " output(s), got ", op.inputs.size(), " and ", op.outputs.size());
}

}  // namespace

const char* to_string(OpType type) {
  switch (type) {
    case OpType::ALL_REDUCE: return "all_reduce";
    case OpType::BROADCAST: return "broadcast";
    case OpType::REDUCE: return "reduce";
    case OpType::ALL_GATHER: return "all_gather";
    case OpType::GATHER: return "gather";
    case OpType::SCATTER: return "scatter";
    case OpType::REDUCE_SCATTER: return "reduce_scatter";
    case OpType::ALL_GATHER_INTO_TENSOR: return "all_gather_into_tensor";
    case OpType::REDUCE_SCATTER_TENSOR: return "reduce_scatter_tensor";
    case OpType::ALL_TO_ALL: return "all_to_all";
    case OpType::BARRIER: return "barrier";
    case OpType::MONITORED_BARRIER: return "monitored_barrier";
    case OpType::SEND: return "send";
    case OpType::RECV: return "recv";
  }
  return "?";
}

// Every argument, before anything is numbered or sent.
void ProcessGroup::check_op(const Op& op) const {
  const char* name = to_string(op.type);
  check_member(name);
  check_counts(name, op);
  TensorChecks c(name, *this);
  const auto& in = op.inputs;
  const auto& out = op.outputs;
  switch (op.type) {
    case OpType::ALL_REDUCE: case OpType::BROADCAST: case OpType::REDUCE:
      c.tensor("tensor", out[0]);
      break;
    case OpType::ALL_GATHER: case OpType::GATHER:
      DTRAIN_CHECK_ARG(in.size() == 1, name, ": one input tensor, got ", in.size());
      c.tensor("input", in[0]);
      break;
    case OpType::SCATTER: case OpType::REDUCE_SCATTER:
      DTRAIN_CHECK_ARG(out.size() == 1, name, ": one output tensor, got ", out.size());
      c.tensor("output", out[0]);
      break;
    case OpType::ALL_GATHER_INTO_TENSOR: case OpType::REDUCE_SCATTER_TENSOR:
      DTRAIN_CHECK_ARG(in.size() == 1 && out.size() == 1, name,
                       ": one input and one output tensor, got ", in.size(), " and ", out.size());
      c.tensor(op.type == OpType::REDUCE_SCATTER_TENSOR ? "output" : "input",
               op.type == OpType::REDUCE_SCATTER_TENSOR ? out[0] : in[0]);
      c.tensor(op.type == OpType::REDUCE_SCATTER_TENSOR ? "input" : "output",
               op.type == OpType::REDUCE_SCATTER_TENSOR ? in[0] : out[0]);
      break;
    case OpType::ALL_TO_ALL:
      c.list_same_dtype("inputs", in, size_);
      c.list_same_dtype("outputs", out, size_);
      c.same_dtype("outputs", out[0], "inputs", in[0]);
      break;
    case OpType::SEND: case OpType::RECV:
      c.tensor("tensor", op.type == OpType::SEND ? in[0] : out[0]);
      if (op.type == OpType::SEND) c.peer("dst", op.root);
      else if (op.root != kAnySource) c.peer("src", op.root);
      DTRAIN_CHECK_ARG(op.root != kAnySource || size() > 1, "recv: from any rank in group '",
                       this->name(), "' of one rank: there is no other rank");
      DTRAIN_CHECK_ARG(op.tag >= 0, name, ": tag must be >= 0, got ", op.tag);
      DTRAIN_CHECK_ARG(op.tag < internal_tags_from() || detail::InternalTraffic::active(), name,
                       ": tag ", op.tag, " is one of dtrain's own on group '", this->name(),
                       "' (", internal_tags_from(), " to ", max_tag(),
                       ": pipeline schedules use them); use a tag below ", internal_tags_from());
      break;
    case OpType::BARRIER: case OpType::MONITORED_BARRIER:
      break;
  }
  if (rooted(op.type)) c.root(op.root);
  switch (op.type) {
    case OpType::ALL_GATHER: c.list_like("outputs", out, in[0], size_); break;
    case OpType::REDUCE_SCATTER: c.list_like("inputs", in, out[0], size_); break;
    case OpType::GATHER: case OpType::SCATTER: {
      const bool gather = op.type == OpType::GATHER;
      const auto& list = gather ? out : in;
      const char* what = gather ? "outputs" : "inputs";
      if (rank_ == op.root) c.list_like(what, list, gather ? in[0] : out[0], size_);
      else c.empty_list(what, list, op.root);
      break;
    }
    case OpType::ALL_GATHER_INTO_TENSOR: c.flat_of("output", out[0], "input", in[0], size_); break;
    case OpType::REDUCE_SCATTER_TENSOR: c.flat_of("input", in[0], "output", out[0], size_); break;
    default: break;
  }
  if (reduces(op.type)) c.reduce_op(op.reduce_op, out[0]);
}

// The one way in for every operation: checks, numbering, flight recorder,
// fingerprint, staging of non-contiguous tensors, then the backend.
WorkPtr ProcessGroup::issue(Op op, Timeout timeout) {
  check_op(op);
  // Taken first: a fingerprint check that begin() issues is not blocking.
  const bool blocking = detail::take_blocking_call();
  const char* name = to_string(op.type);
  const bool collective = is_collective(op.type);
  std::lock_guard<std::mutex> lock(issue_mutex_);
  auto call = next_call(name, timeout, collective);
  const int64_t root = rooted(op.type) || !collective ? op.root : -1;
  const int64_t reduce_op = reduces(op.type) ? static_cast<int64_t>(op.reduce_op) : -1;
  // No fingerprint for point-to-point, nor for monitored_barrier: its check
  // would itself wait for the missing rank.
  const bool checked = collective && op.type != OpType::MONITORED_BARRIER;
  const auto id = checked ? begin(call, subject(op), root, reduce_op)
                          : record(call, subject(op), root, reduce_op);
  if (op.type == OpType::ALL_TO_ALL && recorder_ && id != 0) {
    int64_t sent = 0;
    for (const auto& t : op.inputs) sent += t.numel();
    recorder_->set_numel(id, sent);
  }
  if (op.type == OpType::MONITORED_BARRIER && size_ == 1)
    return tracked(id, call, Work::completed(call.description));
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  for (auto& t : op.inputs) t = t.contiguous();
  for (auto& t : op.outputs) t = stage_output(t, back);
  const int named_source = op.type == OpType::RECV ? op.root : kAnySource;
  call.blocking = blocking && collective && op.type != OpType::MONITORED_BARRIER && on_cpu(op);
  auto work = dispatch(call, std::move(op));
  if (named_source != kAnySource) work->set_source_rank(named_source);
  return tracked(id, call, write_back(std::move(work), std::move(back)));
}

std::vector<WorkPtr> ProcessGroup::issue_batch(std::vector<Op> ops, Timeout timeout) {
  DTRAIN_CHECK_ARG(!ops.empty(), "batch_isend_irecv: the list of operations is empty");
  for (size_t i = 0; i < ops.size(); ++i) {
    DTRAIN_CHECK_ARG(ops[i].type == OpType::SEND || ops[i].type == OpType::RECV,
                     "batch_isend_irecv: operation ", i, " is ", to_string(ops[i].type),
                     "; a batch holds only send and recv");
    try {
      check_op(ops[i]);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::cat("batch_isend_irecv: operation ", i, ": ", e.what()));
    }
  }
  std::lock_guard<std::mutex> lock(issue_mutex_);
  const uint64_t batch = next_batch_++;
  const auto outer = detail::OpLabel::current();
  std::vector<Call> calls;
  std::vector<std::string> labels;
  std::vector<uint64_t> ids;
  std::vector<std::vector<std::pair<at::Tensor, at::Tensor>>> back(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    auto& op = ops[i];
    calls.push_back(next_call(to_string(op.type), timeout, false));
    labels.push_back(detail::cat(outer, outer.empty() ? "" : ", ", "batch_isend_irecv #", batch,
                                 " (", i + 1, " of ", ops.size(), ")"));
    detail::OpLabel label(labels.back());
    ids.push_back(record(calls.back(), subject(op), op.root, -1));
    for (auto& t : op.inputs) t = t.contiguous();
    for (auto& t : op.outputs) t = stage_output(t, back[i]);
  }
  std::vector<int> sources;
  for (const auto& op : ops) sources.push_back(op.type == OpType::RECV ? op.root : kAnySource);
  auto works = dispatch_batch(calls, std::move(ops));
  DTRAIN_ENFORCE_EQ(works.size(), calls.size());
  for (size_t i = 0; i < works.size(); ++i) {
    // A work shared by the batch (nccl's group call) names no one source.
    if (sources[i] != kAnySource && std::count(works.begin(), works.end(), works[i]) == 1)
      works[i]->set_source_rank(sources[i]);
    detail::OpLabel label(labels[i]);
    works[i] = tracked(ids[i], calls[i], write_back(std::move(works[i]), std::move(back[i])));
  }
  return works;
}

// One backend's batch goes to it whole (nccl: one group call); sends and
// receives on tensors of different devices, one by one.
std::vector<WorkPtr> ProcessGroup::dispatch_batch(const std::vector<Call>& calls,
                                                  std::vector<Op> ops) {
  Backend* first = backend_for(ops.front());
  bool one_backend = true;
  for (const auto& op : ops) one_backend = one_backend && backend_for(op) == first;
  if (!first) return post_batch(calls, std::move(ops));
  if (one_backend) return first->post_batch(calls, std::move(ops));
  std::vector<WorkPtr> works;
  for (size_t i = 0; i < ops.size(); ++i) works.push_back(dispatch(calls[i], std::move(ops[i])));
  return works;
}

WorkPtr ProcessGroup::all_reduce(at::Tensor tensor, ReduceOp op, Timeout timeout) {
  return issue(make_op(OpType::ALL_REDUCE, {}, {std::move(tensor)}, -1, op), timeout);
}

WorkPtr ProcessGroup::broadcast(at::Tensor tensor, int root, Timeout timeout) {
  return issue(make_op(OpType::BROADCAST, {}, {std::move(tensor)}, root), timeout);
}

WorkPtr ProcessGroup::reduce(at::Tensor tensor, int root, ReduceOp op, Timeout timeout) {
  return issue(make_op(OpType::REDUCE, {}, {std::move(tensor)}, root, op), timeout);
}

WorkPtr ProcessGroup::all_gather(const std::vector<at::Tensor>& outputs, at::Tensor input,
                                 Timeout timeout) {
  return issue(make_op(OpType::ALL_GATHER, {std::move(input)}, outputs), timeout);
}

WorkPtr ProcessGroup::gather(const std::vector<at::Tensor>& outputs, at::Tensor input, int root,
                             Timeout timeout) {
  return issue(make_op(OpType::GATHER, {std::move(input)}, outputs, root), timeout);
}

WorkPtr ProcessGroup::scatter(at::Tensor output, const std::vector<at::Tensor>& inputs, int root,
                              Timeout timeout) {
  return issue(make_op(OpType::SCATTER, inputs, {std::move(output)}, root), timeout);
}

WorkPtr ProcessGroup::reduce_scatter(at::Tensor output, const std::vector<at::Tensor>& inputs,
                                     ReduceOp op, Timeout timeout) {
  return issue(make_op(OpType::REDUCE_SCATTER, inputs, {std::move(output)}, -1, op), timeout);
}

WorkPtr ProcessGroup::all_gather_into_tensor(at::Tensor output, at::Tensor input,
                                             Timeout timeout) {
  return issue(make_op(OpType::ALL_GATHER_INTO_TENSOR, {std::move(input)}, {std::move(output)}),
               timeout);
}

WorkPtr ProcessGroup::reduce_scatter_tensor(at::Tensor output, at::Tensor input, ReduceOp op,
                                            Timeout timeout) {
  return issue(
      make_op(OpType::REDUCE_SCATTER_TENSOR, {std::move(input)}, {std::move(output)}, -1, op),
      timeout);
}

WorkPtr ProcessGroup::all_to_all(const std::vector<at::Tensor>& outputs,
                                 const std::vector<at::Tensor>& inputs, Timeout timeout) {
  return issue(make_op(OpType::ALL_TO_ALL, inputs, outputs), timeout);
}

WorkPtr ProcessGroup::barrier(Timeout timeout) {
  return issue(make_op(OpType::BARRIER, {}, {}), timeout);
}

WorkPtr ProcessGroup::monitored_barrier(Timeout timeout, bool wait_all_ranks) {
  auto op = make_op(OpType::MONITORED_BARRIER, {}, {});
  op.wait_all_ranks = wait_all_ranks;
  return issue(std::move(op), timeout);
}

int ProcessGroup::max_tag() const {
  int tag = std::numeric_limits<int>::max();
  for (const auto& [type, backend] : backends_) tag = std::min(tag, backend->max_tag());
  return tag;
}

int ProcessGroup::internal_tags_from() const {
  return std::min(1 << 28, static_cast<int>((static_cast<int64_t>(max_tag()) + 1) / 2));
}

WorkPtr ProcessGroup::send(at::Tensor tensor, int dst, int tag, Timeout timeout) {
  auto op = make_op(OpType::SEND, {std::move(tensor)}, {}, dst);
  op.tag = tag;
  return issue(std::move(op), timeout);
}

WorkPtr ProcessGroup::recv(at::Tensor tensor, int src, int tag, Timeout timeout) {
  auto op = make_op(OpType::RECV, {}, {std::move(tensor)}, src);
  op.tag = tag;
  return issue(std::move(op), timeout);
}

}  // namespace dtrain
