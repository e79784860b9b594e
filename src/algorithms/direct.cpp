// gather, scatter and all_to_all: every block goes straight from its source
// to its destination (no byte is relayed). All receives are posted before
// the first send; sends start at the next rank and wrap around, so that not
// every rank sends to rank 0 first.

#include <cstring>

#include "algorithms/util.h"

namespace dtrain::algorithms {

void gather(const Context& ctx, const void* input, void* output, size_t bytes, int root) {
  const int n = ctx.size(), r = ctx.rank();
  auto& t = ctx.transport;
  if (r != root) {
    t.isend(root, ctx.tag, input, bytes)->wait(ctx.deadline, ctx.what);
    return;
  }
  std::vector<transport::RequestPtr> recvs;
  for (int j = 0; j < n; ++j)
    if (j != r) recvs.push_back(t.irecv(j, ctx.tag, at(output, j * bytes), bytes));
  if (bytes) std::memcpy(at(output, r * bytes), input, bytes);
  wait_all(ctx, recvs);
}

void scatter(const Context& ctx, const void* input, void* output, size_t bytes, int root) {
  const int n = ctx.size(), r = ctx.rank();
  auto& t = ctx.transport;
  if (r != root) {
    t.irecv(root, ctx.tag, output, bytes)->wait(ctx.deadline, ctx.what);
    return;
  }
  std::vector<transport::RequestPtr> sends;
  for (int k = 1; k < n; ++k) {
    const int j = mod(r + k, n);
    sends.push_back(t.isend(j, ctx.tag, at(input, j * bytes), bytes));
  }
  if (bytes) std::memcpy(output, at(input, r * bytes), bytes);
  wait_all(ctx, sends);
}

void all_to_all(const Context& ctx, const void* input, const std::vector<size_t>& in_bytes,
                void* output, const std::vector<size_t>& out_bytes) {
  const int n = ctx.size(), r = ctx.rank();
  auto& t = ctx.transport;
  std::vector<size_t> in_off(n + 1, 0), out_off(n + 1, 0);
  for (int j = 0; j < n; ++j) {
    in_off[j + 1] = in_off[j] + in_bytes[j];
    out_off[j + 1] = out_off[j] + out_bytes[j];
  }
  // Every pair exchanges a message, empty ones included: a rank that
  // expects a different size than its peer sends is then caught.
  std::vector<transport::RequestPtr> requests;
  for (int k = 1; k < n; ++k) {
    const int j = mod(r - k, n);
    requests.push_back(t.irecv(j, ctx.tag, at(output, out_off[j]), out_bytes[j]));
  }
  for (int k = 1; k < n; ++k) {
    const int j = mod(r + k, n);
    requests.push_back(t.isend(j, ctx.tag, at(input, in_off[j]), in_bytes[j]));
  }
  if (in_bytes[r]) std::memcpy(at(output, out_off[r]), at(input, in_off[r]), in_bytes[r]);
  wait_all(ctx, requests);
}

}  // namespace dtrain::algorithms
