// The add_* helpers for modules and optimizers: what DDP replicas, one
// process and tensor-parallel layers put into a distributed checkpoint
// (FSDP's: fsdp_state.cpp; ZeroRedundancyOptimizer's: zero_state.cpp).

#include <torch/nn/module.h>

#include <map>
#include <string>

#include "checkpoint/state/placements.h"
#include "checkpoint/state/state_entries.h"
#include "common/enforce.h"
#include "dtrain/checkpoint/distributed.h"
#include "optim/optimizer_state.h"

namespace dtrain::checkpoint {
namespace detail {

void add_buffers(DistributedState& state, torch::nn::Module& module, const std::string& prefix) {
  for (const auto& item : module.named_buffers()) add_replicated(state, prefix + "buffer/" + item.key(), item.value());
}

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
      found.of[p->unsafeGetTensorImpl()] = placement;
      const std::string qualified = (item.key().empty() ? "" : item.key() + ".") + placement.name;
      found.named[qualified] = placement;
    }
  }
  return found;
}

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

}  // namespace detail

using detail::add_buffers;
using detail::add_placed;
using detail::add_step;
using detail::placement_of;
using detail::placements_in;

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

}  // namespace dtrain::checkpoint
