#pragma once

// The per-parameter state of libtorch's optimizers as named tensors (for
// checkpoints, and for ZeRO's shards): Adam and AdamW (exp_avg, exp_avg_sq, max_exp_avg_sq with
// amsgrad, and the step count), SGD (momentum_buffer when momentum is on).

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <utility>
#include <vector>

namespace dtrain::optim::detail {

struct ParamStateView {
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // the live state tensors
  at::Tensor step;  // an int64 scalar holding the step count; undefined: none
  // Writes `step`'s value back into the optimizer (after a load).
  std::function<void()> store_step;
  // Reads the optimizer's step count into `step` (before a save: `step`
  // is a copy, the count of when the view was made).
  std::function<void()> read_step;
};

// Creates the state of `param` as the optimizer's first step would (zeros,
// step 0) when there is none yet, and returns it. InvalidArgument for an
// optimizer type other than Adam, AdamW or SGD, or an SGD with dampening
// and no state yet (its first step would not start from zeros).
ParamStateView param_state(torch::optim::Optimizer& optimizer, const at::Tensor& param);

}  // namespace dtrain::optim::detail
