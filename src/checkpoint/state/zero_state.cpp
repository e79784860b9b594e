// add_zero: ZeroRedundancyOptimizer's sharded state in a distributed
// checkpoint, one entry per parameter and field ("zero/<i>/<field>",
// shaped like parameter i, flattened), so that ZeRO-1 and ZeRO-2 (whose
// partitions differ) write the same checkpoint and either loads it at any
// world size.

#include <memory>

#include "optim/optimizer_state.h"
#include "checkpoint/state/state_entries.h"
#include "dtrain/checkpoint/distributed.h"
#include "dtrain/optim/zero_redundancy_optimizer.h"

namespace dtrain::checkpoint {

using detail::add_sharded;

void add_zero(DistributedState& state, ZeroRedundancyOptimizer& optimizer, const std::string& prefix) {
  auto& local = optimizer.local_optimizer();
  const auto& shards = local.param_groups().at(0).params();
  auto views = std::make_shared<std::vector<optim::detail::ParamStateView>>();
  for (const auto& shard : shards) views->push_back(optim::detail::param_state(local, shard));
  const auto& params = optimizer.param_groups().at(0).params();
  std::vector<const ZeroRedundancyOptimizer::Piece*> piece_of(params.size(), nullptr);
  for (const auto& piece : optimizer.pieces()) piece_of[piece.param] = &piece;
  for (size_t f = 0; f < views->front().tensors.size(); ++f) {
    const std::string& field = views->front().tensors[f].first;
    for (size_t i = 0; i < params.size(); ++i) {
      const auto* piece = piece_of[i];
      const at::Tensor& held = (*views)[piece ? piece->shard : 0].tensors.at(f).second;
      ShardedTensor entry{piece ? held.detach().narrow(0, piece->shard_offset, piece->length)
                                : held.detach().narrow(0, 0, 0),
                          piece ? piece->param_offset : 0, params[i].numel()};
      add_sharded(state, prefix + "zero/" + std::to_string(i) + "/" + field, std::move(entry));
    }
  }
  // One step count (every slice steps together); load() gives it to all.
  auto& first = views->front();
  if (!first.step.defined()) return;
  detail::add_replicated(state, prefix + "zero/step", first.step);
  state.before_save.push_back(first.read_step);
  state.after_load.push_back([views] {
    for (auto& view : *views) {
      view.step.copy_(views->front().step);
      view.store_step();
    }
  });
}

}  // namespace dtrain::checkpoint
