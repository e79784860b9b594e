#pragma once

// The small model and data of the local SGD tests (local_sgd_test in
// ddp_test, local_sgd_ft_test in ft_test).

#include <torch/torch.h>

#include <utility>
#include <vector>

namespace dtrain::testing::local_sgd_model {

// The model's values from a formula of each parameter's place: no
// generator, the same on every rank and in the reference.
inline void set_formula_values(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  int64_t k = 0;
  for (auto& p : model.parameters())
    p.copy_((torch::arange(p.numel(), torch::kFloat) * 0.7 + static_cast<double>(++k)).sin().view_as(p) * 0.5);
}

// Two layers (fragments 0 and 1 of Streaming DiLoCo), Linear(4, 6), tanh,
// Linear(6, 2), values from the formula.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    a = register_module("a", torch::nn::Linear(4, 6));
    b = register_module("b", torch::nn::Linear(6, 2));
    set_formula_values(*this);
  }
  torch::Tensor forward(torch::Tensor x) { return b(torch::tanh(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Net);

// Replica r's batch at step s.
inline std::pair<torch::Tensor, torch::Tensor> batch(int replica, int step) {
  const auto x = (torch::arange(12, torch::kFloat) * (0.31 + 0.07 * replica) + step).sin().view({3, 4});
  const auto y = (torch::arange(6, torch::kFloat) * (0.53 + 0.11 * replica) - step).cos().view({3, 2});
  return {x, y};
}

inline torch::Tensor loss_of(Net& net, int replica, int step) {
  auto [x, y] = batch(replica, step);
  return (net(x) - y).pow(2).mean();
}

inline std::vector<torch::Tensor> values_of(Net& net) {
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

}  // namespace dtrain::testing::local_sgd_model
