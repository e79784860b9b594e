// add_zero: ZeroRedundancyOptimizer's sharded state in a distributed
// checkpoint.

#include "checkpoint/optimizer_state.h"
#include "checkpoint/state_entries.h"
#include "dtrain/checkpoint/distributed.h"
#include "dtrain/optim/zero_redundancy_optimizer.h"

namespace dtrain::checkpoint {

using detail::add_sharded;
using detail::add_step;
using detail::piece_of;

void add_zero(DistributedState& state, ZeroRedundancyOptimizer& optimizer, const std::string& prefix) {
  auto& local = optimizer.local_optimizer();
  const at::Tensor shard = local.param_groups().at(0).params().at(0);
  auto view = detail::param_state(local, shard);
  for (const auto& [field, t] : view.tensors)
    add_sharded(state, prefix + "zero/" + field, piece_of(t, optimizer.shard_begin(), optimizer.numel()));
  add_step(state, prefix + "zero/step", view);
}

}  // namespace dtrain::checkpoint
