#pragma once

// A module's parameters and Adam's first moments by name, copied: what
// checkpoint tests compare before and after a save and a load.

#include <torch/torch.h>

#include <map>
#include <string>

#include "optim/optimizer_state.h"

namespace dtrain::testing {

using NamedTensors = std::map<std::string, at::Tensor>;

inline NamedTensors params_of(torch::nn::Module& m) {
  NamedTensors out;
  for (const auto& item : m.named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

inline NamedTensors exp_avg_of(torch::optim::Optimizer& opt, torch::nn::Module& m) {
  NamedTensors out;
  for (const auto& item : m.named_parameters())
    for (const auto& [field, t] : optim::detail::param_state(opt, item.value()).tensors)
      if (field == "exp_avg") out[item.key()] = t.clone();
  return out;
}

}  // namespace dtrain::testing
