#pragma once

// Which chunks of a sequence each rank of a context-parallel group holds
// (context_parallel.h, Sharding): the sequence is cut into equal chunks,
// c * chunks_per_rank of them, and rank r holds chunks_of(r) in order.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "dtrain/context_parallel.h"

namespace dtrain::context_parallel::detail {

inline int64_t chunks_per_rank(Sharding sharding) { return sharding == Sharding::kHeadTail ? 2 : 1; }

// Rank r's chunks: {r, 2c - 1 - r} head-tail, {r} contiguous.
inline std::vector<int64_t> chunks_of(int64_t rank, int64_t ranks, Sharding sharding) {
  if (sharding == Sharding::kContiguous) return {rank};
  return {rank, 2 * ranks - 1 - rank};
}

// The length of one chunk of a sequence of `length` split over `ranks`;
// refused by name when the chunks would not be equal.
int64_t chunk_length(int64_t length, int64_t ranks, Sharding sharding, const char* what);

// For each position of the gathered order (rank 0's part, then rank 1's,
// ...), the position in the sequence: a permutation of [0, length).
std::vector<int64_t> gathered_positions(int64_t length, int64_t ranks, Sharding sharding);

const char* sharding_name(Sharding sharding);

// q [B, H, S, D], k and v [B, Hkv, S, D] with H a multiple of Hkv; refused
// by name otherwise.
void check_attention_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* what);

}  // namespace dtrain::context_parallel::detail
