// gather, scatter and all_to_all: every block goes straight from its source
// buffer to its destination buffer (no byte is relayed, none staged). All
// receives are posted before the first send; sends start at the next rank
// and wrap around, so that not every rank sends to rank 0 first.

#include <cstring>

#include "algorithms/internal.h"
#include "common/enforce.h"

namespace dtrain::algorithms {

namespace {

// One request with each other rank, from the next one round (so that not
// every rank starts with rank 0): post(j) posts rank j's.
template <typename Post>
std::vector<transport::RequestPtr> with_each_other_rank(const Context& ctx, int step, Post post) {
  std::vector<transport::RequestPtr> requests;
  for (int k = 1; k < ctx.size(); ++k) requests.push_back(post(mod(ctx.rank() + step * k, ctx.size())));
  return requests;
}

}  // namespace

void direct_gather(const Context& ctx, const void* input, size_t bytes,
                   const std::vector<void*>& outputs, int root) {
  const int r = ctx.rank();
  auto& t = ctx.transport;
  if (r != root) return t.isend(root, ctx.tag, input, bytes)->wait(ctx.deadline, ctx.what);
  auto recvs = with_each_other_rank(ctx, 1, [&](int j) { return t.irecv(j, ctx.tag, outputs[j], bytes); });
  if (bytes && outputs[r] != input) std::memcpy(outputs[r], input, bytes);
  wait_all(ctx, recvs);
}

void direct_scatter(const Context& ctx, const std::vector<const void*>& inputs, void* output,
                    size_t bytes, int root) {
  const int r = ctx.rank();
  auto& t = ctx.transport;
  if (r != root) return t.irecv(root, ctx.tag, output, bytes)->wait(ctx.deadline, ctx.what);
  auto sends = with_each_other_rank(ctx, 1, [&](int j) { return t.isend(j, ctx.tag, inputs[j], bytes); });
  if (bytes && output != inputs[r]) std::memcpy(output, inputs[r], bytes);
  wait_all(ctx, sends);
}

void direct_all_to_all(const Context& ctx, const std::vector<const void*>& inputs,
                       const std::vector<size_t>& in_bytes, const std::vector<void*>& outputs,
                       const std::vector<size_t>& out_bytes) {
  const int r = ctx.rank();
  auto& t = ctx.transport;
  if (in_bytes[r] != out_bytes[r])
    throw InvalidArgument(detail::cat(ctx.what, ": inputs[", r, "] holds ", in_bytes[r],
                                      " bytes and outputs[", r, "] ", out_bytes[r],
                                      "; what a rank sends itself must fit"));
  // Every pair exchanges a message, empty ones included: a rank that
  // expects a different size than its peer sends is then caught.
  auto requests = with_each_other_rank(
      ctx, -1, [&](int j) { return t.irecv(j, ctx.tag, outputs[j], out_bytes[j]); });
  for (auto& send : with_each_other_rank(
           ctx, 1, [&](int j) { return t.isend(j, ctx.tag, inputs[j], in_bytes[j]); }))
    requests.push_back(std::move(send));
  if (in_bytes[r] && outputs[r] != inputs[r]) std::memcpy(outputs[r], inputs[r], in_bytes[r]);
  wait_all(ctx, requests);
}

}  // namespace dtrain::algorithms
