#pragma once

// Which rank writes what in a distributed checkpoint. Ranks may hold
// different entries (a pipeline's stages each hold their own parameters;
// HSDP's replicas hold the same pieces): the plan is built from every
// rank's description, the same on every rank.

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dtrain/checkpoint/distributed.h"
#include "dtrain/process_group.h"

namespace dtrain::checkpoint::files {

struct SavePlan {
  std::map<std::string, int> replicated_owner;   // each replicated entry's writer
  std::map<std::string, int64_t> sharded_numel;  // each sharded entry's size
  std::map<std::string, std::vector<int64_t>> sharded_shape;  // a box entry's whole shape
  std::map<std::string, std::vector<int64_t>> flat_shape;     // a flat entry's, where it says it
  std::set<std::string> my_pieces;               // the sharded entries whose piece this rank writes
};

// Collective over `group`. Throws InvalidArgument, the same on every rank,
// when the ranks disagree on an entry (its size or dtype, or whether it is
// replicated, flat or a box, its whole shape), when pieces of a sharded
// entry overlap without being the same piece, or when no rank holds some of
// its elements.
SavePlan plan_save(const std::shared_ptr<ProcessGroup>& group, const DistributedState& state);

}  // namespace dtrain::checkpoint::files
