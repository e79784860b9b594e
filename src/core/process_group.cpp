// The backend-independent half of every collective: argument checks, staging
// of non-contiguous tensors, numbering, and (DTRAIN_DEBUG=DETAIL) the
// cross-rank fingerprint. Backends only ever see validated calls.

#include "dtrain/process_group.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <numeric>

#include "common/enforce.h"
#include "common/logging.h"
#include "diagnostics/fingerprint.h"
#include "diagnostics/flight_recorder.h"
#include "diagnostics/timeline.h"
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

void ProcessGroup::hide_diagnostics(ProcessGroup& inner) {
  std::lock_guard<std::mutex> lock(inner.issue_mutex_);
  inner.diagnostics_hidden_ = true;
  inner.check_collectives_ = false;
  inner.recorder_.reset();
  inner.recorder_made_ = true;  // never made now
}

ProcessGroup::Call ProcessGroup::next_call(const char* op, Timeout timeout, bool collective) {
  auto t = timeout.value_or(options_.timeout());
  DTRAIN_CHECK_ARG(t.count() > 0, op, ": timeout must be positive, got ", t.count(), " ms");
  uint64_t seq = collective ? next_seq_++ : next_p2p_++;
  return Call{op, seq, t,
              detail::cat(op, " #", seq, " on group '", name(), "' (rank ", rank_, "/", size_,
                          ", backend ", backend_name(), ")"),
              collective};
}

uint64_t ProcessGroup::record(const Call& call, const at::Tensor& tensor, int64_t root,
                              int64_t reduce_op) {
  if (!recorder_made_) {  // here, not in the constructor: backend_name() is virtual
    recorder_ = detail::FlightRecorder::create(*this);
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
  if (detail::timeline::enabled() && !diagnostics_hidden_) timeline_span(call, *work);
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
                  name = std::string(call.op), seq = call.seq,
                  collective = call.collective](const std::exception_ptr& error) {
    std::lock_guard<std::mutex> lock(track->mutex);
    const auto end = tl::Clock::now();
    const auto begin = std::max(issued, track->last_end);
    track->last_end = end;
    tl::span(name, track->id, begin, end,
             detail::cat("\"seq\": ", seq, ", \"kind\": \"", collective ? "collective" : "p2p",
                         "\", \"ok\": ", error ? "false" : "true"));
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
  do_all_gather(check, rows, mine)->wait();
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

std::vector<at::Tensor> stage_outputs(const std::vector<at::Tensor>& ts,
                                      std::vector<std::pair<at::Tensor, at::Tensor>>& back) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(stage_output(t, back));
  return out;
}

std::vector<at::Tensor> contiguous(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(t.contiguous());
  return out;
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

WorkPtr ProcessGroup::all_reduce(at::Tensor tensor, ReduceOp op, Timeout timeout) {
  check_member("all_reduce");
  TensorChecks c("all_reduce", *this);
  c.tensor("tensor", tensor);
  c.reduce_op(op, tensor);
  std::lock_guard<std::mutex> lock(issue_mutex_);
  auto call = next_call("all_reduce", timeout, true);
  const auto id = begin(call, tensor, -1, static_cast<int64_t>(op));
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  auto staged = stage_output(tensor, back);
  return tracked(id, call, write_back(do_all_reduce(call, staged, op), std::move(back)));
}

WorkPtr ProcessGroup::broadcast(at::Tensor tensor, int root, Timeout timeout) {
  check_member("broadcast");
  TensorChecks c("broadcast", *this);
  c.tensor("tensor", tensor);
  c.root(root);
  std::lock_guard<std::mutex> lock(issue_mutex_);
  auto call = next_call("broadcast", timeout, true);
  const auto id = begin(call, tensor, root, -1);
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  auto staged = stage_output(tensor, back);
  return tracked(id, call, write_back(do_broadcast(call, staged, root), std::move(back)));
}

WorkPtr ProcessGroup::reduce(at::Tensor tensor, int root, ReduceOp op, Timeout timeout) {
  check_member("reduce");
  TensorChecks c("reduce", *this);
  c.tensor("tensor", tensor);
  c.root(root);
  c.reduce_op(op, tensor);
  std::lock_guard<std::mutex> lock(issue_mutex_);
  auto call = next_call("reduce", timeout, true);
  const auto id = begin(call, tensor, root, static_cast<int64_t>(op));
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  auto staged = stage_output(tensor, back);
  return tracked(id, call, write_back(do_reduce(call, staged, root, op), std::move(back)));
}

WorkPtr ProcessGroup::all_gather(const std::vector<at::Tensor>& outputs, at::Tensor input,
                                 Timeout timeout) {
  check_member("all_gather");
  TensorChecks c("all_gather", *this);
  c.tensor("input", input);
  c.list_like("outputs", outputs, input, size_);
  std::lock_guard<std::mutex> lock(issue_mutex_);
  auto call = next_call("all_gather", timeout, true);
  const auto id = begin(call, input, -1, -1);
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  auto staged = stage_outputs(outputs, back);
  return tracked(id, call, write_back(do_all_gather(call, staged, input.contiguous()), std::move(back)));
}

WorkPtr ProcessGroup::gather(const std::vector<at::Tensor>& outputs, at::Tensor input, int root,
                             Timeout timeout) {
  check_member("gather");
  TensorChecks c("gather", *this);
  c.tensor("input", input);
  c.root(root);
  if (rank_ == root) {
    c.list_like("outputs", outputs, input, size_);
  } else {
    c.empty_list("outputs", outputs, root);
  }
  std::lock_guard<std::mutex> lock(issue_mutex_);
  auto call = next_call("gather", timeout, true);
  const auto id = begin(call, input, root, -1);
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  auto staged = stage_outputs(outputs, back);
  return tracked(id, call, write_back(do_gather(call, staged, input.contiguous(), root), std::move(back)));
}

WorkPtr ProcessGroup::scatter(at::Tensor output, const std::vector<at::Tensor>& inputs, int root,
                              Timeout timeout) {
  check_member("scatter");
  TensorChecks c("scatter", *this);
  c.tensor("output", output);
  c.root(root);
  if (rank_ == root) {
    c.list_like("inputs", inputs, output, size_);
  } else {
    c.empty_list("inputs", inputs, root);
  }
  std::lock_guard<std::mutex> lock(issue_mutex_);
  auto call = next_call("scatter", timeout, true);
  const auto id = begin(call, output, root, -1);
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  auto staged = stage_output(output, back);
  return tracked(id, call, write_back(do_scatter(call, staged, contiguous(inputs), root), std::move(back)));
}

WorkPtr ProcessGroup::reduce_scatter(at::Tensor output, const std::vector<at::Tensor>& inputs,
                                     ReduceOp op, Timeout timeout) {
  check_member("reduce_scatter");
  TensorChecks c("reduce_scatter", *this);
  c.tensor("output", output);
  c.list_like("inputs", inputs, output, size_);
  c.reduce_op(op, output);
  std::lock_guard<std::mutex> lock(issue_mutex_);
  auto call = next_call("reduce_scatter", timeout, true);
  const auto id = begin(call, output, -1, static_cast<int64_t>(op));
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  auto staged = stage_output(output, back);
  return tracked(id, call, write_back(do_reduce_scatter(call, staged, contiguous(inputs), op), std::move(back)));
}

namespace {

// `flat`'s n rows as tensors shaped like `piece` (views, no copy).
std::vector<at::Tensor> rows_of(const at::Tensor& flat, const at::Tensor& piece, int n) {
  auto rows = flat.view({n, piece.numel()}).unbind(0);
  std::vector<at::Tensor> out;
  out.reserve(rows.size());
  for (auto& r : rows) out.push_back(r.view(piece.sizes()));
  return out;
}

}  // namespace

WorkPtr ProcessGroup::all_gather_into_tensor(at::Tensor output, at::Tensor input,
                                             Timeout timeout) {
  check_member("all_gather_into_tensor");
  TensorChecks c("all_gather_into_tensor", *this);
  c.tensor("input", input);
  c.tensor("output", output);
  c.flat_of("output", output, "input", input, size_);
  std::lock_guard<std::mutex> lock(issue_mutex_);
  auto call = next_call("all_gather_into_tensor", timeout, true);
  const auto id = begin(call, input, -1, -1);
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  auto staged = stage_output(output, back);
  return tracked(id, call, write_back(do_all_gather_into_tensor(call, staged, input.contiguous()), std::move(back)));
}

WorkPtr ProcessGroup::reduce_scatter_tensor(at::Tensor output, at::Tensor input, ReduceOp op,
                                            Timeout timeout) {
  check_member("reduce_scatter_tensor");
  TensorChecks c("reduce_scatter_tensor", *this);
  c.tensor("output", output);
  c.tensor("input", input);
  c.flat_of("input", input, "output", output, size_);
  c.reduce_op(op, output);
  std::lock_guard<std::mutex> lock(issue_mutex_);
  auto call = next_call("reduce_scatter_tensor", timeout, true);
  const auto id = begin(call, output, -1, static_cast<int64_t>(op));
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  auto staged = stage_output(output, back);
  return tracked(id, call, write_back(do_reduce_scatter_tensor(call, staged, input.contiguous(), op),
                    std::move(back)));
}

WorkPtr ProcessGroup::do_all_gather_into_tensor(const Call& call, at::Tensor output,
                                                at::Tensor input) {
  auto rows = rows_of(output, input, size_);  // before `input` is moved from
  return do_all_gather(call, std::move(rows), std::move(input));
}

WorkPtr ProcessGroup::do_reduce_scatter_tensor(const Call& call, at::Tensor output,
                                               at::Tensor input, ReduceOp op) {
  auto rows = rows_of(input, output, size_);  // before `output` is moved from
  return do_reduce_scatter(call, std::move(output), std::move(rows), op);
}

WorkPtr ProcessGroup::all_to_all(const std::vector<at::Tensor>& outputs,
                                 const std::vector<at::Tensor>& inputs, Timeout timeout) {
  check_member("all_to_all");
  TensorChecks c("all_to_all", *this);
  c.list_same_dtype("inputs", inputs, size_);
  c.list_same_dtype("outputs", outputs, size_);
  c.same_dtype("outputs", outputs[0], "inputs", inputs[0]);
  std::lock_guard<std::mutex> lock(issue_mutex_);
  auto call = next_call("all_to_all", timeout, true);
  // Peers may send different sizes; the fingerprint covers dtype only.
  const auto id = begin(call, inputs[0].flatten().narrow(0, 0, 0), -1, -1);
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  auto staged = stage_outputs(outputs, back);
  return tracked(id, call, write_back(do_all_to_all(call, staged, contiguous(inputs)), std::move(back)));
}

WorkPtr ProcessGroup::barrier(Timeout timeout) {
  check_member("barrier");
  std::lock_guard<std::mutex> lock(issue_mutex_);
  auto call = next_call("barrier", timeout, true);
  const auto id = begin(call, at::Tensor(), -1, -1);
  return tracked(id, call, do_barrier(call));
}

// No fingerprint: its check would itself wait for the missing rank.
WorkPtr ProcessGroup::monitored_barrier(Timeout timeout, bool wait_all_ranks) {
  check_member("monitored_barrier");
  std::lock_guard<std::mutex> lock(issue_mutex_);
  auto call = next_call("monitored_barrier", timeout, true);
  const auto id = record(call, at::Tensor(), -1, -1);
  if (size_ == 1) return tracked(id, call, Work::completed(call.description));
  return tracked(id, call, do_monitored_barrier(call, wait_all_ranks));
}

WorkPtr ProcessGroup::send(at::Tensor tensor, int dst, int tag, Timeout timeout) {
  check_member("send");
  TensorChecks c("send", *this);
  c.tensor("tensor", tensor);
  c.peer("dst", dst);
  DTRAIN_CHECK_ARG(tag >= 0, "send: tag must be >= 0, got ", tag);
  std::lock_guard<std::mutex> lock(issue_mutex_);
  auto call = next_call("send", timeout, false);
  const auto id = record(call, tensor, dst, -1);
  return tracked(id, call, do_send(call, tensor.contiguous(), dst, tag));
}

WorkPtr ProcessGroup::recv(at::Tensor tensor, int src, int tag, Timeout timeout) {
  check_member("recv");
  TensorChecks c("recv", *this);
  c.tensor("tensor", tensor);
  if (src != kAnySource) c.peer("src", src);
  DTRAIN_CHECK_ARG(src != kAnySource || size() > 1, "recv: from any rank in group '", name(),
                   "' of one rank: there is no other rank");
  DTRAIN_CHECK_ARG(tag >= 0, "recv: tag must be >= 0, got ", tag);
  std::lock_guard<std::mutex> lock(issue_mutex_);
  auto call = next_call("recv", timeout, false);
  const auto id = record(call, tensor, src, -1);
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  auto staged = stage_output(tensor, back);
  auto work = do_recv(call, staged, src, tag);
  if (src != kAnySource) work->set_source_rank(src);
  return tracked(id, call, write_back(std::move(work), std::move(back)));
}

}  // namespace dtrain
