#pragma once

// One rank's part of a snapshot (snapshot.h): the rank's tensors and the
// state's metadata as a tensor file in memory, and its way back into a
// state of the same layout.

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/checkpoint/distributed.h"

namespace dtrain::checkpoint::snapshot_part {

// The part holds the replicated entries named in `owned` (each is kept by
// one rank only: save()'s plan) and every sharded piece of the state.
std::string encode(const DistributedState& state, const std::set<std::string>& owned, int64_t step, int rank,
                   int world);

using Fills = std::vector<std::pair<at::Tensor, at::Tensor>>;  // {destination, value}
struct Decoded {
  Fills fills;                                // into this rank's state
  std::map<std::string, at::Tensor> owned;    // the part's replicated entries
  std::vector<std::string> needs;             // the state's replicated entries that other parts hold
  std::map<std::string, std::string> metadata;
};

// Checks `bytes` against `state` (the same sharded pieces, shapes and
// dtypes, taken by `rank` of `world` at `step`; replicated entries the
// state holds) and returns what to copy; InvalidArgument "<what>:
// <problem>" otherwise.
Decoded check(const std::string& bytes, const DistributedState& state, int64_t step, int rank, int world,
              const std::string& what);

}  // namespace dtrain::checkpoint::snapshot_part
