// The latency algorithms (select.cpp runs them below kLatencyBytes), and
// broadcast's chain for large messages.
//
// Small all_reduce: recursive doubling. With m the largest power of two not
// above n, ranks m..n-1 first hand their data to rank r-m and get the result
// back at the end. Among the first m, at round k each rank exchanges its
// partial result with rank r^2^k and combines the two with the lower rank's
// operand first, so both partners hold bitwise the same value: log2(m)
// rounds instead of the ring's 2(n-1).
//
// Broadcast: a binomial tree for small messages (log2(n) rounds); a
// pipelined chain root, root+1, ... for large ones, each rank forwarding a
// piece as soon as it has it (every link carries the message once).
//
// Reduce: a binomial tree (for large messages, ring.cpp's ring_reduce).
//
// Barrier: dissemination, log2(n) rounds of one-byte messages to r+2^k.

#include <c10/core/ScalarType.h>

#include <cstring>
#include <memory>

#include "algorithms/reduce_kernels.h"
#include "algorithms/internal.h"

namespace dtrain::algorithms {

void recursive_doubling_all_reduce(const Context& ctx, void* data, size_t count,
                                   c10::ScalarType dtype, ReduceOp op) {
  const int n = ctx.size(), r = ctx.rank();
  const size_t bytes = count * c10::elementSize(dtype);
  auto& t = ctx.transport;
  int m = 1;
  while (m * 2 <= n) m *= 2;
  if (r >= m) {  // folded in: hand over, get the result back
    t.isend(r - m, ctx.tag, data, bytes)->wait(ctx.deadline, ctx.what);
    t.irecv(r - m, ctx.tag, data, bytes)->wait(ctx.deadline, ctx.what);
    return;
  }
  uint8_t* tmp = ctx.scratch.get(std::max<size_t>(bytes, 1));
  if (r + m < n) {
    t.irecv(r + m, ctx.tag, tmp, bytes)->wait(ctx.deadline, ctx.what);
    kernels::accumulate_into(dtype, op, data, tmp, count);
  }
  for (int mask = 1; mask < m; mask <<= 1) {
    const int partner = r ^ mask;
    auto recv = t.irecv(partner, ctx.tag, tmp, bytes);
    auto send = t.isend(partner, ctx.tag, data, bytes);
    send->wait(ctx.deadline, ctx.what);
    recv->wait(ctx.deadline, ctx.what);
    if (r < partner) {
      kernels::accumulate_into(dtype, op, data, tmp, count);
    } else {  // the partner's (lower) operand first
      kernels::accumulate_into(dtype, op, tmp, data, count);
      std::memcpy(data, tmp, bytes);
    }
  }
  if (r + m < n) t.isend(r + m, ctx.tag, data, bytes)->wait(ctx.deadline, ctx.what);
}

void binomial_broadcast(const Context& ctx, void* data, size_t bytes, int root) {
  const int n = ctx.size(), q = mod(ctx.rank() - root, n);
  auto& t = ctx.transport;
  int mask = 1;
  for (; mask < n; mask <<= 1) {
    if (q & mask) {
      t.irecv(mod(q - mask + root, n), ctx.tag, data, bytes)->wait(ctx.deadline, ctx.what);
      break;
    }
  }
  std::vector<transport::RequestPtr> sends;
  for (mask >>= 1; mask > 0; mask >>= 1)
    if (q + mask < n) sends.push_back(t.isend(mod(q + mask + root, n), ctx.tag, data, bytes));
  wait_all(ctx, sends);
}

void chain_broadcast(const Context& ctx, void* data, size_t bytes, int root) {
  const int n = ctx.size(), r = ctx.rank(), q = mod(r - root, n);
  auto& t = ctx.transport;
  std::vector<transport::RequestPtr> recvs, sends;
  if (q > 0)
    for (size_t p = 0; p < piece_count(bytes); ++p)
      recvs.push_back(t.irecv(mod(r - 1, n), ctx.tag, at(data, p * kPieceBytes),
                              piece_bytes(bytes, p)));
  for (size_t p = 0; p < piece_count(bytes); ++p) {
    if (q > 0) recvs[p]->wait(ctx.deadline, ctx.what);
    if (q < n - 1)
      sends.push_back(t.isend(mod(r + 1, n), ctx.tag, at(data, p * kPieceBytes),
                              piece_bytes(bytes, p)));
  }
  wait_all(ctx, sends);
}

// Reduces up a binomial tree rooted at root: rank q combines q+1, q+2,
// q+4, ... below it, in that order, into its data (root) or a copy of it.
void binomial_reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype,
                     ReduceOp op, int root) {
  const int n = ctx.size(), q = mod(ctx.rank() - root, n);
  const size_t bytes = count * c10::elementSize(dtype);
  void* acc = data;
  if (q != 0) {  // other ranks' data stays as given
    acc = ctx.copy.get(bytes);
    std::memcpy(acc, data, bytes);
  }
  auto& t = ctx.transport;
  uint8_t* tmp = ctx.scratch.get(std::max<size_t>(bytes, 1));
  for (int mask = 1; mask < n; mask <<= 1) {
    if (q & mask) {
      t.isend(mod(q - mask + root, n), ctx.tag, acc, bytes)->wait(ctx.deadline, ctx.what);
      return;
    }
    if (q + mask < n) {
      t.irecv(mod(q + mask + root, n), ctx.tag, tmp, bytes)->wait(ctx.deadline, ctx.what);
      kernels::accumulate_into(dtype, op, acc, tmp, count);
    }
  }
}

void dissemination_barrier(const Context& ctx) {
  const int n = ctx.size(), r = ctx.rank();
  auto& t = ctx.transport;
  uint8_t out = 1, in = 0;
  for (int k = 1; k < n; k <<= 1) {
    auto recv = t.irecv(mod(r - k, n), ctx.tag, &in, 1);
    t.isend(mod(r + k, n), ctx.tag, &out, 1)->wait(ctx.deadline, ctx.what);
    recv->wait(ctx.deadline, ctx.what);
  }
}

}  // namespace dtrain::algorithms
