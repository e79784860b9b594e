// The add_* helpers: what DDP replicas, ZeroRedundancyOptimizer and FSDP
// put into a distributed checkpoint.

#include <torch/nn/module.h>

#include "checkpoint/optimizer_state.h"
#include "common/enforce.h"
#include "dtrain/checkpoint/distributed.h"
#include "dtrain/optim/zero_redundancy_optimizer.h"

namespace dtrain::checkpoint {
namespace {

void add_replicated(DistributedState& state, const std::string& name, const at::Tensor& t) {
  DTRAIN_CHECK_ARG(state.replicated.count(name) == 0 && state.sharded.count(name) == 0,
                   "checkpoint: '", name, "' is added twice (give the second object a prefix)");
  state.replicated[name] = t;
}

void add_sharded(DistributedState& state, const std::string& name, ShardedTensor piece) {
  DTRAIN_CHECK_ARG(state.replicated.count(name) == 0 && state.sharded.count(name) == 0,
                   "checkpoint: '", name, "' is added twice (give the second object a prefix)");
  state.sharded[name] = std::move(piece);
}

// A step count: saved as a scalar, put back into the optimizer by load().
void add_step(DistributedState& state, const std::string& name, detail::ParamStateView& view) {
  if (!view.step.defined()) return;
  add_replicated(state, name, view.step);
  state.after_load.push_back(view.store_step);
}

// This rank's slice [offset, offset + slice) of a flat space of `numel`
// elements, without the padding past its end.
ShardedTensor piece_of(const at::Tensor& flat_slice, int64_t offset, int64_t numel) {
  const int64_t length = std::max<int64_t>(0, std::min(flat_slice.numel(), numel - offset));
  return ShardedTensor{flat_slice.detach().view({-1}).narrow(0, 0, length),
                       std::min(offset, numel), numel};
}

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
    auto view = detail::param_state(optimizer, item.value());
    for (const auto& [field, t] : view.tensors) add_replicated(state, base + field, t);
    add_step(state, base + "step", view);
  }
}

void add_zero(DistributedState& state, ZeroRedundancyOptimizer& optimizer, const std::string& prefix) {
  auto& local = optimizer.local_optimizer();
  const at::Tensor shard = local.param_groups().at(0).params().at(0);
  auto view = detail::param_state(local, shard);
  for (const auto& [field, t] : view.tensors)
    add_sharded(state, prefix + "zero/" + field, piece_of(t, optimizer.shard_begin(), optimizer.numel()));
  add_step(state, prefix + "zero/step", view);
}

void add_fsdp_shards(DistributedState& state, const std::vector<FSDPShard>& shards,
                     torch::optim::Optimizer& optimizer, torch::nn::Module& module,
                     const std::string& prefix) {
  for (const auto& s : shards) {
    const std::string base = prefix + "fsdp/" + (s.unit.empty() ? "root" : s.unit) + "/";
    add_sharded(state, base + "param", piece_of(s.shard, s.offset, s.numel));
    auto view = detail::param_state(optimizer, s.shard);
    for (const auto& [field, t] : view.tensors) add_sharded(state, base + field, piece_of(t, s.offset, s.numel));
    add_step(state, base + "step", view);
  }
  add_buffers(state, module, prefix);
}

}  // namespace dtrain::checkpoint
