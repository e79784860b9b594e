#pragma once

// Small helpers shared by the algorithm files. Private to src/algorithms/.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "algorithms/collectives.h"

namespace dtrain::algorithms {

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

// The ring halves (ring.cpp), used by all_reduce, reduce and the list forms.
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

// two_level.cpp: whether ctx's topology allows the two-level all_reduce
// (several hosts, as many ranks on each, more than one), and that all_reduce.
bool two_level_fits(const Context& ctx);
void two_level_all_reduce(const Context& ctx, void* data, size_t count, c10::ScalarType dtype,
                          ReduceOp op);
// The same two levels for all_gather and reduce_scatter (same arguments as
// theirs), and whether they apply: a topology that fits, above
// kLatencyBytes of output (all_gather) or input (reduce_scatter), unless
// DTRAIN_ALGO forces a flat algorithm.
bool two_level_for(const Context& ctx, size_t total_bytes);
void two_level_all_gather(const Context& ctx, const void* input, void* output, size_t bytes);
void two_level_reduce_scatter(const Context& ctx, const void* input, void* output, size_t count,
                              c10::ScalarType dtype, ReduceOp op);

}  // namespace dtrain::algorithms
