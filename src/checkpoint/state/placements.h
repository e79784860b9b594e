#pragma once

// Where a module's tensor-parallel parameters lie (ShardedParameters), and
// adding a parameter-shaped tensor to a state as replicated or as its box:
// shared by the module builders (state_builders.cpp) and FSDP's
// (fsdp_state.cpp).

#include <torch/nn/module.h>

#include <map>
#include <string>

#include "dtrain/checkpoint/distributed.h"
#include "dtrain/parameter_placement.h"

namespace dtrain::checkpoint::detail {

void add_buffers(DistributedState& state, torch::nn::Module& module, const std::string& prefix);

// The placements of the parameters of `module`'s ShardedParameters
// modules, by parameter and by qualified name.
struct Placements {
  std::map<const c10::TensorImpl*, ParameterPlacement> of;
  std::map<std::string, ParameterPlacement> named;
};
Placements placements_in(torch::nn::Module& module);

// `t` (a parameter, or optimizer state shaped like it) as a replicated
// entry, or, where the parameter is placed in a whole, as its box.
void add_placed(DistributedState& state, const std::string& name, const at::Tensor& t,
                const ParameterPlacement* placement);
const ParameterPlacement* placement_of(const Placements& placed, const at::Tensor& param);

}  // namespace dtrain::checkpoint::detail
