#pragma once

// One rank's part of a snapshot (dtrain/checkpoint/snapshot.h) or of a
// live peer's state (peer/): the rank's tensors and the state's metadata
// as a tensor file in memory, checksummed, and its way back into a state
// of the same layout. Shared by the storages that move parts whole.

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/storage/storage.h"
#include "dtrain/checkpoint/distributed.h"

namespace dtrain::checkpoint::snapshot_part {

// The part holds its replicated entries (each is kept by one rank only:
// the plan's owner) and every sharded piece of the rank's state.
std::string encode(const storage::Part& part, int64_t step, int rank, int world);

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
