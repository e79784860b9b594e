// torch.distributed-style free functions: pick the group, translate global
// ranks to group ranks, run, and wait unless async_op.

#include <ATen/core/grad_mode.h>  // at::NoGradGuard (its own header on libtorch 2.x)

#include "common/enforce.h"
#include "core/blocking_call.h"
#include "diagnostics/flight_recorder.h"
#include "dtrain/distributed.h"

namespace dtrain {
namespace {

std::shared_ptr<ProcessGroup> pick(const std::shared_ptr<ProcessGroup>& group) {
  return group ? group : default_group();
}

int to_group_rank(const ProcessGroup& g, int global_rank, const char* op, const char* what) {
  int r = g.group_rank_of(global_rank);
  DTRAIN_CHECK_ARG(r >= 0, op, ": ", what, " rank ", global_rank, " is not a member of group '",
                   g.name(), "' (global ranks ", detail::join(g.global_ranks()), ")");
  return r;
}

WorkPtr finish(WorkPtr work, bool async_op) {
  if (!async_op) work->wait();
  return work;
}

// ReduceOp::PREMUL_SUM is SUM over inputs scaled by the factor first
// (done here, so every backend has it); true when `o` asks for it.
bool premul_sum(const ReduceOptions& o, const at::Tensor& t, const char* op) {
  if (o.op() != ReduceOp::PREMUL_SUM) return false;
  DTRAIN_CHECK_ARG(t.defined() && at::isFloatingType(t.scalar_type()), op,
                   ": ReduceOp::PREMUL_SUM is for floating tensors, got dtype ",
                   t.defined() ? c10::toString(t.scalar_type()) : "undefined");
  return true;
}

at::Tensor scaled(const at::Tensor& t, double factor) {
  at::NoGradGuard no_grad;
  return t * factor;
}

}  // namespace

WorkPtr all_reduce(at::Tensor tensor, const AllReduceOptions& o) {
  const detail::BlockingCall blocking(!o.async_op());
  auto g = pick(o.group());
  if (premul_sum(o, tensor, "all_reduce")) {
    {
      at::NoGradGuard no_grad;
      tensor.mul_(o.premul_factor());  // it is the output anyway
    }
    return finish(g->all_reduce(std::move(tensor), ReduceOp::SUM, o.timeout()), o.async_op());
  }
  return finish(g->all_reduce(std::move(tensor), o.op(), o.timeout()), o.async_op());
}

WorkPtr broadcast(at::Tensor tensor, int src, const CollectiveOptions& o) {
  const detail::BlockingCall blocking(!o.async_op());
  auto g = pick(o.group());
  return finish(g->broadcast(std::move(tensor), to_group_rank(*g, src, "broadcast", "src"),
                             o.timeout()),
                o.async_op());
}

WorkPtr reduce(at::Tensor tensor, int dst, const ReduceOptions& o) {
  const detail::BlockingCall blocking(!o.async_op());
  auto g = pick(o.group());
  if (premul_sum(o, tensor, "reduce")) {
    // Other ranks' tensors stay as they are: reduce a scaled copy.
    const int root = to_group_rank(*g, dst, "reduce", "dst");
    auto copy = scaled(tensor, o.premul_factor());
    auto work = g->reduce(copy, root, ReduceOp::SUM, o.timeout());
    if (g->rank() == root) work->on_success([tensor, copy]() mutable { tensor.copy_(copy); });
    return finish(std::move(work), o.async_op());
  }
  return finish(g->reduce(std::move(tensor), to_group_rank(*g, dst, "reduce", "dst"), o.op(),
                          o.timeout()),
                o.async_op());
}

WorkPtr all_gather(const std::vector<at::Tensor>& outputs, at::Tensor input,
                   const CollectiveOptions& o) {
  const detail::BlockingCall blocking(!o.async_op());
  return finish(pick(o.group())->all_gather(outputs, std::move(input), o.timeout()), o.async_op());
}

WorkPtr gather(at::Tensor input, const std::vector<at::Tensor>& outputs, int dst,
               const CollectiveOptions& o) {
  auto g = pick(o.group());
  return finish(g->gather(outputs, std::move(input), to_group_rank(*g, dst, "gather", "dst"),
                          o.timeout()),
                o.async_op());
}

WorkPtr scatter(at::Tensor output, const std::vector<at::Tensor>& inputs, int src,
                const CollectiveOptions& o) {
  auto g = pick(o.group());
  return finish(g->scatter(std::move(output), inputs, to_group_rank(*g, src, "scatter", "src"),
                           o.timeout()),
                o.async_op());
}

WorkPtr reduce_scatter(at::Tensor output, const std::vector<at::Tensor>& inputs,
                       const ReduceScatterOptions& o) {
  if (premul_sum(o, output, "reduce_scatter")) {
    std::vector<at::Tensor> copies;
    for (const auto& t : inputs) copies.push_back(t.defined() ? scaled(t, o.premul_factor()) : t);
    return finish(pick(o.group())->reduce_scatter(std::move(output), copies, ReduceOp::SUM,
                                                  o.timeout()),
                  o.async_op());
  }
  return finish(pick(o.group())->reduce_scatter(std::move(output), inputs, o.op(), o.timeout()),
                o.async_op());
}

void monitored_barrier(const std::shared_ptr<ProcessGroup>& group, Timeout timeout,
                       bool wait_all_ranks) {
  pick(group)->monitored_barrier(timeout, wait_all_ranks)->wait();
}

WorkPtr all_gather_into_tensor(at::Tensor output, at::Tensor input, const CollectiveOptions& o) {
  const detail::BlockingCall blocking(!o.async_op());
  return finish(pick(o.group())->all_gather_into_tensor(std::move(output), std::move(input),
                                                        o.timeout()),
                o.async_op());
}

WorkPtr reduce_scatter_tensor(at::Tensor output, at::Tensor input, const ReduceScatterOptions& o) {
  const detail::BlockingCall blocking(!o.async_op());
  if (premul_sum(o, input, "reduce_scatter_tensor")) {
    return finish(pick(o.group())->reduce_scatter_tensor(
                      std::move(output), scaled(input, o.premul_factor()), ReduceOp::SUM,
                      o.timeout()),
                  o.async_op());
  }
  return finish(pick(o.group())->reduce_scatter_tensor(std::move(output), std::move(input),
                                                       o.op(), o.timeout()),
                o.async_op());
}

WorkPtr all_to_all(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                   const CollectiveOptions& o) {
  return finish(pick(o.group())->all_to_all(outputs, inputs, o.timeout()), o.async_op());
}

namespace {

// `t`'s dim-0 rows cut by `splits` (equal parts when empty): views.
std::vector<at::Tensor> split_rows(const at::Tensor& t, const std::vector<int64_t>& splits,
                                   int parts, const char* what) {
  DTRAIN_CHECK_ARG(t.defined() && t.dim() >= 1, "all_to_all_single: ", what,
                   " must be a tensor of at least one dimension");
  const int64_t rows = t.size(0);
  std::vector<int64_t> sizes = splits;
  if (sizes.empty()) {
    DTRAIN_CHECK_ARG(rows % parts == 0, "all_to_all_single: ", what, "'s dim 0 (", rows,
                     ") does not divide into ", parts, " equal parts; pass ", what,
                     "_split_sizes");
    sizes.assign(parts, rows / parts);
  }
  DTRAIN_CHECK_ARG(static_cast<int>(sizes.size()) == parts, "all_to_all_single: ", what,
                   "_split_sizes has ", sizes.size(), " entries for a group of ", parts);
  int64_t sum = 0;
  for (auto n : sizes) {
    DTRAIN_CHECK_ARG(n >= 0, "all_to_all_single: ", what, "_split_sizes [", detail::join(sizes),
                     "] has a negative size");
    sum += n;
  }
  DTRAIN_CHECK_ARG(sum == rows, "all_to_all_single: ", what, "_split_sizes [",
                   detail::join(sizes), "] sum to ", sum, " but ", what, " has ", rows,
                   " rows (dim 0)");
  std::vector<at::Tensor> out;
  int64_t at_row = 0;
  for (auto n : sizes) out.push_back(t.narrow(0, at_row, n)), at_row += n;
  return out;
}

}  // namespace

WorkPtr all_to_all_single(at::Tensor output, at::Tensor input,
                          const std::vector<int64_t>& output_split_sizes,
                          const std::vector<int64_t>& input_split_sizes,
                          const CollectiveOptions& o) {
  auto g = pick(o.group());
  const int n = g->size();
  auto outputs = split_rows(output, output_split_sizes, n, "output");
  auto inputs = split_rows(input, input_split_sizes, n, "input");
  return finish(g->all_to_all(outputs, inputs, o.timeout()), o.async_op());
}

std::string dump_flight_recorder(const std::string& dir) {
  return detail::dump_all("dump_flight_recorder()", dir);
}

WorkPtr barrier(const CollectiveOptions& o) {
  const detail::BlockingCall blocking(!o.async_op());
  return finish(pick(o.group())->barrier(o.timeout()), o.async_op());
}

WorkPtr isend(at::Tensor tensor, int dst, const P2POptions& o) {
  auto g = pick(o.group());
  return g->send(std::move(tensor), to_group_rank(*g, dst, "send", "dst"), o.tag(), o.timeout());
}

WorkPtr irecv(at::Tensor tensor, int src, const P2POptions& o) {
  auto g = pick(o.group());
  const int from = src == kAnySource ? kAnySource : to_group_rank(*g, src, "recv", "src");
  return g->recv(std::move(tensor), from, o.tag(), o.timeout());
}

std::vector<WorkPtr> batch_isend_irecv(const std::vector<P2POp>& list) {
  DTRAIN_CHECK_ARG(!list.empty(), "batch_isend_irecv: the list of operations is empty");
  auto g = pick(list[0].group);
  std::vector<Op> ops;
  for (size_t i = 0; i < list.size(); ++i) {
    const auto& p = list[i];
    const bool send = p.op == &isend;
    DTRAIN_CHECK_ARG(send || p.op == &irecv, "batch_isend_irecv: operation ", i,
                     "'s op is neither dtrain::isend nor dtrain::irecv");
    DTRAIN_CHECK_ARG(pick(p.group) == g, "batch_isend_irecv: operation ", i,
                     " uses another group than operation 0 (group '", pick(p.group)->name(),
                     "' against '", g->name(), "'); every operation must use the same group");
    Op op;
    op.type = send ? OpType::SEND : OpType::RECV;
    (send ? op.inputs : op.outputs).push_back(p.tensor);
    try {
      op.root = !send && p.peer == kAnySource
                    ? kAnySource
                    : to_group_rank(*g, p.peer, send ? "send" : "recv", send ? "dst" : "src");
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::cat("batch_isend_irecv: operation ", i, ": ", e.what()));
    }
    op.tag = p.tag;
    ops.push_back(std::move(op));
  }
  return g->issue_batch(std::move(ops));
}

void send(at::Tensor tensor, int dst, const P2POptions& o) { isend(std::move(tensor), dst, o)->wait(); }

int recv(at::Tensor tensor, int src, const P2POptions& o) {
  auto g = pick(o.group());
  auto work = irecv(std::move(tensor), src, o);
  work->wait();
  // A named source is the answer; only a receive from any rank asks the work
  // (on device work wait() returns before the work has finished).
  if (src != kAnySource) return src;
  const int r = work->source_rank();
  return g->global_ranks()[static_cast<size_t>(r)];
}

}  // namespace dtrain
