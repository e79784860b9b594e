// The add_* helpers: what DDP replicas and FSDP put into a distributed
// checkpoint (ZeroRedundancyOptimizer's: zero_state.cpp).

#include <torch/nn/module.h>

#include <map>
#include <string>

#include "optim/optimizer_state.h"
#include "checkpoint/state_entries.h"
#include "common/enforce.h"
#include "dtrain/checkpoint/distributed.h"
#include "dtrain/parameter_placement.h"

namespace dtrain::checkpoint {
namespace {

using detail::add_replicated;
using detail::add_sharded;
using detail::add_step;
using detail::piece_of;

void add_buffers(DistributedState& state, torch::nn::Module& module, const std::string& prefix) {
  for (const auto& item : module.named_buffers()) add_replicated(state, prefix + "buffer/" + item.key(), item.value());
}

// The placements of the parameters of `module`'s ShardedParameters
// modules, by parameter (and the qualified name of the first such one).
struct Placements {
  std::map<const c10::TensorImpl*, ParameterPlacement> of;
  std::string first;
};

Placements placements_in(torch::nn::Module& module) {
  Placements found;
  for (const auto& item : module.named_modules()) {
    const auto* sharded = dynamic_cast<const ShardedParameters*>(item.value().get());
    if (!sharded) continue;
    const auto params = item.value()->named_parameters(/*recurse=*/false);
    for (const auto& placement : sharded->parameter_placements()) {
      const auto* p = params.find(placement.name);
      DTRAIN_CHECK_ARG(p, "checkpoint: module '", item.key(), "' places a parameter '", placement.name,
                       "' that it does not have");
      // A group of one rank: the "shard" is the whole tensor, as replicated.
      if (p->sizes().vec() == placement.shape) continue;
      found.of[p->unsafeGetTensorImpl()] = placement;
      if (found.first.empty())
        found.first = (item.key().empty() ? "" : item.key() + ".") + placement.name;
    }
  }
  return found;
}

// `t` (a parameter, or optimizer state shaped like it) as a replicated
// entry, or, where the parameter is placed in a whole, as its box.
void add_placed(DistributedState& state, const std::string& name, const at::Tensor& t,
                const ParameterPlacement* placement) {
  if (!placement || t.dim() != static_cast<int64_t>(placement->shape.size())) {
    add_replicated(state, name, t);
    return;
  }
  add_sharded(state, name, ShardedTensor::box(t.detach(), placement->shape, placement->offsets));
}

const ParameterPlacement* placement_of(const Placements& placed, const at::Tensor& param) {
  auto it = placed.of.find(param.unsafeGetTensorImpl());
  return it == placed.of.end() ? nullptr : &it->second;
}

}  // namespace

void add_module(DistributedState& state, torch::nn::Module& module, const std::string& prefix) {
  const auto placed = placements_in(module);
  for (const auto& item : module.named_parameters())
    add_placed(state, prefix + "param/" + item.key(), item.value(), placement_of(placed, item.value()));
  add_buffers(state, module, prefix);
}

void add_optimizer(DistributedState& state, torch::optim::Optimizer& optimizer,
                   torch::nn::Module& module, const std::string& prefix) {
  const auto placed = placements_in(module);
  for (const auto& item : module.named_parameters()) {
    const std::string base = prefix + "optim/" + item.key() + "/";
    auto view = optim::detail::param_state(optimizer, item.value());
    for (const auto& [field, t] : view.tensors)
      add_placed(state, base + field, t, placement_of(placed, item.value()));
    add_step(state, base + "step", view);
  }
}

void add_fsdp_shards(DistributedState& state, const std::vector<FSDPShard>& shards,
                     torch::optim::Optimizer& optimizer, torch::nn::Module& module,
                     const std::string& prefix) {
  const auto placed = placements_in(module);
  DTRAIN_CHECK_ARG(placed.of.empty(), "checkpoint::add_fsdp: the module holds tensor-parallel shards ('",
                   placed.first, "'); FSDP's flat units differ from one TP rank to the next, and "
                   "checkpoints of FSDP x TP are not built yet (add_module on a TP model without "
                   "FSDP, or on one that holds full_state_dict()'s tensors, is)");
  for (const auto& s : shards) {
    const std::string base = prefix + "fsdp/" + (s.unit.empty() ? "root" : s.unit) + "/";
    add_sharded(state, base + "param", piece_of(s.shard, s.offset, s.numel));
    auto view = optim::detail::param_state(optimizer, s.shard);
    for (const auto& [field, t] : view.tensors) add_sharded(state, base + field, piece_of(t, s.offset, s.numel));
    add_step(state, base + "step", view);
  }
  add_buffers(state, module, prefix);
}

}  // namespace dtrain::checkpoint
