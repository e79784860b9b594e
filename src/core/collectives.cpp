// torch.distributed-style free functions: pick the group, translate global
// ranks to group ranks, run, and wait unless async_op.

#include "common/enforce.h"
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

}  // namespace

WorkPtr all_reduce(at::Tensor tensor, const AllReduceOptions& o) {
  return finish(pick(o.group())->all_reduce(std::move(tensor), o.op(), o.timeout()), o.async_op());
}

WorkPtr broadcast(at::Tensor tensor, int src, const CollectiveOptions& o) {
  auto g = pick(o.group());
  return finish(g->broadcast(std::move(tensor), to_group_rank(*g, src, "broadcast", "src"),
                             o.timeout()),
                o.async_op());
}

WorkPtr reduce(at::Tensor tensor, int dst, const ReduceOptions& o) {
  auto g = pick(o.group());
  return finish(g->reduce(std::move(tensor), to_group_rank(*g, dst, "reduce", "dst"), o.op(),
                          o.timeout()),
                o.async_op());
}

WorkPtr all_gather(const std::vector<at::Tensor>& outputs, at::Tensor input,
                   const CollectiveOptions& o) {
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
  return finish(pick(o.group())->reduce_scatter(std::move(output), inputs, o.op(), o.timeout()),
                o.async_op());
}

void monitored_barrier(const std::shared_ptr<ProcessGroup>& group, Timeout timeout,
                       bool wait_all_ranks) {
  pick(group)->monitored_barrier(timeout, wait_all_ranks)->wait();
}

WorkPtr all_gather_into_tensor(at::Tensor output, at::Tensor input, const CollectiveOptions& o) {
  return finish(pick(o.group())->all_gather_into_tensor(std::move(output), std::move(input),
                                                        o.timeout()),
                o.async_op());
}

WorkPtr reduce_scatter_tensor(at::Tensor output, at::Tensor input, const ReduceScatterOptions& o) {
  return finish(pick(o.group())->reduce_scatter_tensor(std::move(output), std::move(input),
                                                       o.op(), o.timeout()),
                o.async_op());
}

WorkPtr all_to_all(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                   const CollectiveOptions& o) {
  return finish(pick(o.group())->all_to_all(outputs, inputs, o.timeout()), o.async_op());
}

WorkPtr barrier(const CollectiveOptions& o) {
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
