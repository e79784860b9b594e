#pragma once

// Adding entries to a DistributedState, shared by the add_* helpers
// (state_builders.cpp, zero_state.cpp).

#include <algorithm>
#include <string>

#include "optim/optimizer_state.h"
#include "common/enforce.h"
#include "dtrain/checkpoint/distributed.h"

namespace dtrain::checkpoint::detail {

inline void add_replicated(DistributedState& state, const std::string& name, const at::Tensor& t) {
  DTRAIN_CHECK_ARG(state.replicated.count(name) == 0 && state.sharded.count(name) == 0,
                   "checkpoint: '", name, "' is added twice (give the second object a prefix)");
  state.replicated[name] = t;
}

inline void add_sharded(DistributedState& state, const std::string& name, ShardedTensor piece) {
  DTRAIN_CHECK_ARG(state.replicated.count(name) == 0 && state.sharded.count(name) == 0,
                   "checkpoint: '", name, "' is added twice (give the second object a prefix)");
  state.sharded[name] = std::move(piece);
}

// A step count: saved as a scalar, put back into the optimizer by load().
inline void add_step(DistributedState& state, const std::string& name, optim::detail::ParamStateView& view) {
  if (!view.step.defined()) return;
  add_replicated(state, name, view.step);
  state.after_load.push_back(view.store_step);
  state.before_save.push_back(view.read_step);
}

// This rank's slice [offset, offset + slice) of a flat space of `numel`
// elements, without the padding past its end.
inline ShardedTensor piece_of(const at::Tensor& flat_slice, int64_t offset, int64_t numel) {
  const int64_t length = std::max<int64_t>(0, std::min(flat_slice.numel(), numel - offset));
  return ShardedTensor{flat_slice.detach().view({-1}).narrow(0, 0, length),
                       std::min(offset, numel), numel};
}

}  // namespace dtrain::checkpoint::detail
