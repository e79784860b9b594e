#pragma once

// The algorithms behind collectives.h, each over one transport (or a Subset
// of it) and contiguous buffers, and the helpers they share; select.cpp
// picks among them. Private to src/algorithms/.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "algorithms/collectives.h"

namespace dtrain::algorithms {

// Marks the tag of a collective's second phase (ring all_reduce's gather).
constexpr uint64_t kSecondHalf = uint64_t{1} << 62;
// Mark the tags of the two-level algorithms' phases inside a host and
// across hosts (two_level.cpp), each of which may use kSecondHalf too.
constexpr uint64_t kInsideHost = uint64_t{1} << 61;
constexpr uint64_t kAcrossHosts = uint64_t{1} << 60;

// Below this many bytes the latency algorithms run (recursive doubling,
// binomial trees); above it the bandwidth ones (pipelined ring and chain).
constexpr size_t kLatencyBytes = 64 * 1024;
// Large messages move in pieces of this size so that the next hop starts
// (and reductions overlap the transfer) before the whole block has arrived.
constexpr size_t kPieceBytes = 512 * 1024;

inline int mod(int a, int n) { return ((a % n) + n) % n; }

inline uint8_t* at(void* base, size_t offset) { return static_cast<uint8_t*>(base) + offset; }
inline const uint8_t* at(const void* base, size_t offset) {
  return static_cast<const uint8_t*>(base) + offset;
}

inline void wait_all(const Context& ctx, std::vector<transport::RequestPtr>& requests) {
  for (auto& r : requests) r->wait(ctx.deadline, ctx.what);
  requests.clear();
}

// A buffer of n blocks: block b covers [begin(b), begin(b) + bytes(b)).
// The last blocks may be shorter, or empty, when the total does not divide.
struct Blocks {
  size_t stride;
  size_t total;
  size_t begin(int b) const { return std::min(total, static_cast<size_t>(b) * stride); }
  size_t bytes(int b) const { return std::min(total, (static_cast<size_t>(b) + 1) * stride) - begin(b); }
};

// Pieces of a block, each at most kPieceBytes (a multiple of every element
// size).
inline size_t piece_count(size_t bytes) { return (bytes + kPieceBytes - 1) / kPieceBytes; }
inline size_t piece_bytes(size_t bytes, size_t p) {
  return std::min(kPieceBytes, bytes - p * kPieceBytes);
}

// ---- ring.cpp: the ring halves, and the collectives made of them.
// reduce-scatter leaves block r of `base` reduced over ranks on rank r;
// all-gather spreads block r of every rank to all.
void ring_reduce_scatter(const Context& ctx, void* base, const Blocks& blocks,
                         c10::ScalarType dtype, ReduceOp op);
// The all-gather's receives may be posted ahead (all_reduce posts them
// before its reduce-scatter, under a tag of their own, so that no piece of
// the second half arrives before its receive and has to be held and copied).
using Posted = std::vector<std::vector<transport::RequestPtr>>;
Posted post_all_gather_recvs(const Context& ctx, void* base, const Blocks& blocks, uint64_t tag);
void ring_all_gather(const Context& ctx, void* base, const Blocks& blocks, uint64_t tag,
                     Posted recvs);
// The reductions below take AVG as SUM: the caller divides.
// data becomes op over ranks (at least one element per rank).
void ring_all_reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype,
                     ReduceOp op);
// output: size() blocks of `bytes`; block i receives rank i's input.
void ring_all_gather_into(const Context& ctx, const void* input, void* output, size_t bytes);
// work: size() blocks of `count` elements, modified; output receives op
// over ranks of block rank().
void ring_reduce_scatter_from(const Context& ctx, void* work, void* output, size_t count,
                              c10::ScalarType dtype, ReduceOp op);
// On root, data becomes op over ranks: a ring reduce-scatter on a copy, then
// every rank sends its reduced block to root.
void ring_reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype,
                 ReduceOp op, int root);

// ---- tree.cpp: the latency algorithms, and the broadcast chain.
void recursive_doubling_all_reduce(const Context& ctx, void* data, size_t count,
                                   c10::ScalarType dtype, ReduceOp op);
void binomial_broadcast(const Context& ctx, void* data, size_t bytes, int root);
void chain_broadcast(const Context& ctx, void* data, size_t bytes, int root);
void binomial_reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype,
                     ReduceOp op, int root);
void dissemination_barrier(const Context& ctx);

// ---- direct.cpp: every block straight from its source to its destination.
void direct_gather(const Context& ctx, const void* input, size_t bytes,
                   const std::vector<void*>& outputs, int root);
void direct_scatter(const Context& ctx, const std::vector<const void*>& inputs, void* output,
                    size_t bytes, int root);
void direct_all_to_all(const Context& ctx, const std::vector<const void*>& inputs,
                       const std::vector<size_t>& in_bytes, const std::vector<void*>& outputs,
                       const std::vector<size_t>& out_bytes);

// ---- two_level.cpp: over several hosts with the same number of ranks each.
// Whether ctx's topology allows them (several hosts, as many ranks on each,
// more than one).
bool two_level_fits(const Context& ctx);
void two_level_all_reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype,
                          ReduceOp op);
// output: size() blocks of `bytes`; input: size() blocks of `count`
// elements (not modified).
void two_level_all_gather(const Context& ctx, const void* input, void* output, size_t bytes);
void two_level_reduce_scatter(const Context& ctx, const void* input, void* output, size_t count,
                              c10::ScalarType dtype, ReduceOp op);

}  // namespace dtrain::algorithms
