#include "checkpoint/storage/storage.h"

namespace dtrain::checkpoint::storage {

Part Writer::select(const DistributedState& state, const SavePlan& plan, int rank) const {
  Part part;
  for (const auto& [name, t] : state.replicated)
    if (plan.replicated_owner.at(name) == rank) part.replicated[name] = t;
  for (const auto& [name, s] : state.sharded)
    if (plan.my_pieces.count(name)) part.sharded[name] = s;
  part.metadata = state.metadata;
  return part;
}

}  // namespace dtrain::checkpoint::storage
