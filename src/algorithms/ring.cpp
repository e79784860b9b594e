// The bandwidth algorithms: a ring of ranks, each sending to its right
// neighbour and receiving from its left one.
//
// Reduce-scatter. The buffer is cut into n blocks. At step s (0..n-2) rank r
// sends block r-s-1 and receives block r-s-2, which it reduces into its own
// copy; the block it just reduced is the one it sends next. After n-1 steps
// block r has passed every rank once and holds the full reduction, on rank r
// only. Each block also moves in pieces: as soon as piece p of a block is
// reduced it leaves for the next rank, so the ring runs as a pipeline and
// reductions overlap the transfers. Received pieces land in one of two
// scratch blocks, alternating by step.
//
// All-gather. Rank r starts with its block r; at step s it forwards block
// r-s, received at the previous step, and receives block r-s-1 straight into
// place. Every receive is posted before the first send.
//
// Each rank sends and receives (n-1)/n of the buffer in each half, the
// minimum; all_reduce is the two halves (2(n-1)/n).

#include <c10/core/ScalarType.h>

#include <cstring>
#include <memory>

#include "algorithms/reduce_kernels.h"
#include "algorithms/internal.h"

namespace dtrain::algorithms {

void ring_reduce_scatter(const Context& ctx, void* base, const Blocks& blocks,
                         c10::ScalarType dtype, ReduceOp op) {
  const int n = ctx.size(), r = ctx.rank();
  if (n == 1) return;
  const int right = mod(r + 1, n), left = mod(r - 1, n);
  const size_t elem = c10::elementSize(dtype);
  auto& t = ctx.transport;
  uint8_t* scratch = ctx.scratch.get(2 * std::max<size_t>(blocks.stride, 1));
  auto scratch_of = [&](int s) { return scratch + (s % 2) * blocks.stride; };
  auto recv_block = [&](int s) { return mod(r - s - 2, n); };

  std::vector<transport::RequestPtr> recvs[2], sends;
  auto post_recvs = [&](int s) {
    const size_t bytes = blocks.bytes(recv_block(s));
    for (size_t p = 0; p < piece_count(bytes); ++p)
      recvs[s % 2].push_back(t.irecv(left, ctx.tag, scratch_of(s) + p * kPieceBytes,
                                     piece_bytes(bytes, p)));
  };
  post_recvs(0);
  {
    const int b = mod(r - 1, n);
    const size_t bytes = blocks.bytes(b);
    for (size_t p = 0; p < piece_count(bytes); ++p)
      sends.push_back(t.isend(right, ctx.tag, at(base, blocks.begin(b) + p * kPieceBytes),
                              piece_bytes(bytes, p)));
  }
  for (int s = 0; s <= n - 2; ++s) {
    const bool last = s == n - 2;
    if (!last) post_recvs(s + 1);
    const int b = recv_block(s);
    const size_t bytes = blocks.bytes(b);
    for (size_t p = 0; p < piece_count(bytes); ++p) {
      recvs[s % 2][p]->wait(ctx.deadline, ctx.what);
      const size_t len = piece_bytes(bytes, p);
      uint8_t* mine = at(base, blocks.begin(b) + p * kPieceBytes);
      kernels::accumulate_into(dtype, op, mine, scratch_of(s) + p * kPieceBytes, len / elem);
      if (!last) sends.push_back(t.isend(right, ctx.tag, mine, len));
    }
    recvs[s % 2].clear();
  }
  // The scratch blocks and the sent blocks must outlive the transfers.
  wait_all(ctx, sends);
}

Posted post_all_gather_recvs(const Context& ctx, void* base, const Blocks& blocks,
                             uint64_t tag) {
  const int n = ctx.size(), r = ctx.rank(), left = mod(r - 1, n);
  Posted recvs(n - 1);
  for (int s = 0; s <= n - 2; ++s) {
    const int b = mod(r - s - 1, n);
    const size_t bytes = blocks.bytes(b);
    for (size_t p = 0; p < piece_count(bytes); ++p)
      recvs[s].push_back(ctx.transport.irecv(
          left, tag, at(base, blocks.begin(b) + p * kPieceBytes), piece_bytes(bytes, p)));
  }
  return recvs;
}

void ring_all_gather(const Context& ctx, void* base, const Blocks& blocks, uint64_t tag,
                     Posted recvs) {
  const int n = ctx.size(), r = ctx.rank();
  if (n == 1) return;
  const int right = mod(r + 1, n);
  auto& t = ctx.transport;
  std::vector<transport::RequestPtr> sends;
  const size_t own = blocks.bytes(r);
  for (size_t p = 0; p < piece_count(own); ++p)
    sends.push_back(t.isend(right, tag, at(base, blocks.begin(r) + p * kPieceBytes),
                            piece_bytes(own, p)));
  for (int s = 0; s <= n - 2; ++s) {
    const int b = mod(r - s - 1, n);
    const size_t bytes = blocks.bytes(b);
    for (size_t p = 0; p < piece_count(bytes); ++p) {
      recvs[s][p]->wait(ctx.deadline, ctx.what);
      if (s < n - 2)
        sends.push_back(t.isend(right, tag, at(base, blocks.begin(b) + p * kPieceBytes),
                                piece_bytes(bytes, p)));
    }
  }
  wait_all(ctx, sends);
}

void ring_all_reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype,
                     ReduceOp op) {
  const int n = ctx.size();
  const size_t elem = c10::elementSize(dtype);
  const Blocks blocks{(count + n - 1) / n * elem, count * elem};
  // A piece of the second half can only arrive once this rank has sent its
  // share of that block in the first: receiving straight into place early
  // is safe, and spares holding and copying pieces that come early.
  const uint64_t gather_tag = ctx.tag | kSecondHalf;
  auto gather_recvs = post_all_gather_recvs(ctx, data, blocks, gather_tag);
  ring_reduce_scatter(ctx, data, blocks, dtype, op);
  ring_all_gather(ctx, data, blocks, gather_tag, std::move(gather_recvs));
}

void ring_all_gather_into(const Context& ctx, const void* input, void* output, size_t bytes) {
  const Blocks blocks{bytes, bytes * ctx.size()};
  uint8_t* mine = at(output, blocks.begin(ctx.rank()));
  if (bytes && mine != input) std::memcpy(mine, input, bytes);  // else gathered in place
  ring_all_gather(ctx, output, blocks, ctx.tag, post_all_gather_recvs(ctx, output, blocks, ctx.tag));
}

void ring_reduce_scatter_from(const Context& ctx, void* work, void* output, size_t count,
                              c10::ScalarType dtype, ReduceOp op) {
  const size_t bytes = count * c10::elementSize(dtype);
  const Blocks blocks{bytes, bytes * ctx.size()};
  ring_reduce_scatter(ctx, work, blocks, dtype, op);
  if (bytes) std::memcpy(output, at(work, blocks.begin(ctx.rank())), bytes);
}

void ring_reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype,
                 ReduceOp op, int root) {
  const int n = ctx.size(), r = ctx.rank();
  const size_t elem = c10::elementSize(dtype), bytes = count * elem;
  // Every rank reduces on a copy: root's blocks arrive into data, and the
  // others' data stays as given.
  void* acc = ctx.copy.get(bytes);
  std::memcpy(acc, data, bytes);
  const Blocks blocks{(count + n - 1) / n * elem, bytes};
  ring_reduce_scatter(ctx, acc, blocks, dtype, op);
  auto& t = ctx.transport;
  if (r != root) {
    t.isend(root, ctx.tag, at(acc, blocks.begin(r)), blocks.bytes(r))
        ->wait(ctx.deadline, ctx.what);
    return;
  }
  std::vector<transport::RequestPtr> recvs;
  for (int j = 0; j < n; ++j)
    if (j != r) recvs.push_back(t.irecv(j, ctx.tag, at(data, blocks.begin(j)), blocks.bytes(j)));
  std::memcpy(at(data, blocks.begin(r)), at(acc, blocks.begin(r)), blocks.bytes(r));
  wait_all(ctx, recvs);
}

}  // namespace dtrain::algorithms
