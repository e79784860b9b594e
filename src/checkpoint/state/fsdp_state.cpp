// The add_* helpers for FSDP: its flat units as they are, or, for tensor-
// parallel layers and for weights by name, each parameter gathered whole
// over the FSDP group (a collective; this file is the one of the builders
// that talks to a process group).

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <string>
#include <vector>

#include "checkpoint/state/placements.h"
#include "checkpoint/state/state_entries.h"
#include "common/enforce.h"
#include "dtrain/checkpoint/distributed.h"
#include "dtrain/fsdp.h"
#include "dtrain/process_group.h"
#include "optim/optimizer_state.h"

namespace dtrain::checkpoint {

using detail::add_buffers;
using detail::add_placed;
using detail::add_sharded;
using detail::add_step;
using detail::piece_of;
using detail::Placements;
using detail::placements_in;

namespace {

// All of a unit's flat `slice`s over its group, into `flat` ([slice numel
// x group size]).
void gather_into(const at::Tensor& flat, const at::Tensor& slice, ProcessGroup& group) {
  at::NoGradGuard no_grad;
  group.all_gather_into_tensor(flat, slice.detach().reshape({-1}))->wait();
}

// The unit's parameters (or one field of their optimizer state) from its
// gathered flat tensor, each under base + name + suffix, placed as the TP
// layer says. The entries are views of that one buffer, gathered again
// before every save (a state built once saves the values of each save, not
// of when it was built); after a load, this rank's slice goes back into
// `slice`.
void add_unit_tensors(DistributedState& state, const FSDPShard& s, const Placements& placed,
                      const at::Tensor& slice, const std::string& base, const std::string& suffix) {
  const at::Tensor flat =
      at::empty({slice.numel() * s.group->size()}, slice.options().requires_grad(false));
  gather_into(flat, slice, *s.group);
  state.before_save.push_back([flat, slice, group = s.group] { gather_into(flat, slice, *group); });
  for (size_t i = 0; i < s.param_names.size(); ++i) {
    int64_t n = 1;
    for (int64_t d : s.param_shapes[i]) n *= d;
    const auto found = placed.named.find(s.param_names[i]);
    add_placed(state, base + s.param_names[i] + suffix, flat.narrow(0, s.param_offsets[i], n).view(s.param_shapes[i]),
               found == placed.named.end() ? nullptr : &found->second);
  }
  state.after_load.push_back([flat, slice, offset = s.offset] {
    at::NoGradGuard no_grad;
    slice.detach().view({-1}).copy_(flat.narrow(0, offset, slice.numel()));
  });
}

// FSDP over tensor-parallel layers: the entries add_module and
// add_optimizer would write, each parameter gathered whole over the FSDP
// group (its TP box of the whole), so the checkpoint loads at any TP and
// DP size, under FSDP or not.
void add_fsdp_gathered(DistributedState& state, const std::vector<FSDPShard>& shards,
                       torch::optim::Optimizer& optimizer, const Placements& placed,
                       const std::string& prefix) {
  for (const auto& s : shards) {
    DTRAIN_ENFORCE(s.group != nullptr);
    add_unit_tensors(state, s, placed, s.shard, prefix + "param/", "");
    auto view = optim::detail::param_state(optimizer, s.shard);
    for (const auto& [field, t] : view.tensors)
      add_unit_tensors(state, s, placed, t, prefix + "optim/", "/" + field);
    for (const auto& name : s.param_names) add_step(state, prefix + "optim/" + name + "/step", view);
  }
}

// Each parameter of the unit as the flat range of it that this rank's
// slice holds (views of the slice: nothing gathered, nothing copied), with
// the parameter's shape, so that the entry reads whole elsewhere.
void add_parameter_ranges(DistributedState& state, const FSDPShard& s, const std::string& base) {
  const at::Tensor flat = s.shard.detach().view({-1});
  const int64_t lo = s.offset, hi = s.offset + flat.numel();
  for (size_t i = 0; i < s.param_names.size(); ++i) {
    int64_t n = 1;
    for (int64_t d : s.param_shapes[i]) n *= d;
    const int64_t begin = s.param_offsets[i], end = begin + n;
    const int64_t a = std::min(std::max(lo, begin), end), b = std::max(a, std::min(hi, end));
    ShardedTensor piece{flat.narrow(0, std::clamp<int64_t>(a - lo, 0, flat.numel()), b - a), a - begin, n, {}, {},
                        s.param_shapes[i]};
    add_sharded(state, base + s.param_names[i], std::move(piece));
  }
}

}  // namespace

void add_fsdp_parameter_shards(DistributedState& state, const std::vector<FSDPShard>& shards,
                               torch::nn::Module& module, const std::string& prefix) {
  const auto placed = placements_in(module);
  for (const auto& s : shards) {
    DTRAIN_ENFORCE(s.group != nullptr);
    if (placed.of.empty())
      add_parameter_ranges(state, s, prefix + "param/");
    else  // a TP layer's box of its whole: gathered over the FSDP group
      add_unit_tensors(state, s, placed, s.shard, prefix + "param/", "");
  }
  add_buffers(state, module, prefix);
}

void add_fsdp_shards(DistributedState& state, const std::vector<FSDPShard>& shards,
                     torch::optim::Optimizer& optimizer, torch::nn::Module& module,
                     const std::string& prefix) {
  const auto placed = placements_in(module);
  if (!placed.of.empty()) {
    add_fsdp_gathered(state, shards, optimizer, placed, prefix);
    add_buffers(state, module, prefix);
    return;
  }
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
