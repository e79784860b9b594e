// The add_* helpers: what DDP replicas and FSDP put into a distributed
// checkpoint (ZeroRedundancyOptimizer's: zero_state.cpp).

#include <torch/nn/module.h>

#include "optim/optimizer_state.h"
#include "checkpoint/state_entries.h"
#include "common/enforce.h"
#include "dtrain/checkpoint/distributed.h"

namespace dtrain::checkpoint {
namespace {

using detail::add_replicated;
using detail::add_sharded;
using detail::add_step;
using detail::piece_of;

void add_buffers(DistributedState& state, torch::nn::Module& module, const std::string& prefix) {
  for (const auto& item : module.named_buffers()) add_replicated(state, prefix + "buffer/" + item.key(), item.value());
}

}  // namespace

void add_module(DistributedState& state, torch::nn::Module& module, const std::string& prefix) {
  for (const auto& item : module.named_parameters()) add_replicated(state, prefix + "param/" + item.key(), item.value());
  add_buffers(state, module, prefix);
}

void add_optimizer(DistributedState& state, torch::optim::Optimizer& optimizer,
                   torch::nn::Module& module, const std::string& prefix) {
  for (const auto& item : module.named_parameters()) {
    const std::string base = prefix + "optim/" + item.key() + "/";
    auto view = optim::detail::param_state(optimizer, item.value());
    for (const auto& [field, t] : view.tensors) add_replicated(state, base + field, t);
    add_step(state, base + "step", view);
  }
}

void add_fsdp_shards(DistributedState& state, const std::vector<FSDPShard>& shards,
                     torch::optim::Optimizer& optimizer, torch::nn::Module& module,
                     const std::string& prefix) {
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
