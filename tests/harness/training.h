#pragma once

// Data, models and optimizers shared by the DDP and DataParallel tests.

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "harness/models.h"

namespace dtrain::testing {

template <typename Impl>
torch::Tensor inputs_for(int64_t n) {
  if constexpr (std::is_same_v<Impl, ConvNetImpl>) return torch::randn({n, 1, 8, 8});
  return torch::randn({n, 10});
}

// The global RNG is shared by threads: build models on the main thread.
template <typename Impl>
std::shared_ptr<Impl> make_model(int seed = 0) {
  torch::manual_seed(seed);
  return std::make_shared<Impl>();
}

struct Batch {
  torch::Tensor x, y;
};

// `steps` batches of `rows` inputs and regression targets of width 4.
template <typename Impl>
std::vector<Batch> make_data(int64_t rows, int steps) {
  torch::manual_seed(1234);
  std::vector<Batch> data;
  for (int s = 0; s < steps; ++s) data.push_back({inputs_for<Impl>(rows), torch::randn({rows, 4})});
  return data;
}

// Optimizer factories shared by the ZeRO and FSDP tests (the form
// ZeroRedundancyOptimizer takes).
using MakeOptimizer =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;
inline const MakeOptimizer kAdam = [](std::vector<torch::Tensor> p) {
  return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-2).weight_decay(1e-3));
};
inline const MakeOptimizer kSgdMomentum = [](std::vector<torch::Tensor> p) {
  return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.05).momentum(0.9));
};

inline torch::optim::SGD make_sgd(const std::vector<torch::Tensor>& params) {
  return torch::optim::SGD(params, torch::optim::SGDOptions(0.1).momentum(0.9));
}

}  // namespace dtrain::testing
