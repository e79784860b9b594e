#pragma once

// One rank's part of a snapshot (snapshot.h): the rank's tensors and the
// state's metadata as a tensor file in memory, and its way back into a
// state of the same layout.

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/checkpoint/distributed.h"

namespace dtrain::checkpoint::snapshot_part {

std::string encode(const DistributedState& state, int64_t step, int rank, int world);

// Checks `bytes` against `state` (the same entries, shapes, dtypes and
// pieces, taken by `rank` of `world` at `step`) and returns the copies to
// make; throws InvalidArgument "<what>: <problem>" otherwise.
using Fills = std::vector<std::pair<at::Tensor, at::Tensor>>;  // {destination, value}
Fills check(const std::string& bytes, const DistributedState& state, int64_t step, int rank, int world,
            const std::string& what, std::map<std::string, std::string>* metadata);

}  // namespace dtrain::checkpoint::snapshot_part
