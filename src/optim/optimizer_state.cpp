#include "optim/optimizer_state.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <type_traits>
#include <typeinfo>

#include "common/enforce.h"
#include "common/torch_compat.h"

namespace dtrain::optim::detail {
namespace {

// libtorch keys an optimizer's state by the parameter's TensorImpl: as a
// string in 1.13, as the pointer in later releases.
template <typename Map>
typename Map::key_type key_of(const Map&, const at::Tensor& param) {
  if constexpr (std::is_same_v<typename Map::key_type, std::string>)
    return compat::pointer_text(param.unsafeGetTensorImpl());
  else
    return param.unsafeGetTensorImpl();
}

template <typename State>
State& state_of(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                const std::function<std::unique_ptr<State>()>& make) {
  auto& states = optimizer.state();
  const auto key = key_of(states, param);
  auto it = states.find(key);
  if (it == states.end()) it = states.emplace(key, make()).first;
  return static_cast<State&>(*it->second);
}

template <typename State>
ParamStateView adam_like(torch::optim::Optimizer& optimizer, const at::Tensor& param, bool amsgrad) {
  auto& s = state_of<State>(optimizer, param, [&] {
    auto fresh = std::make_unique<State>();
    fresh->step(0);
    fresh->exp_avg(at::zeros_like(param, at::MemoryFormat::Preserve));
    fresh->exp_avg_sq(at::zeros_like(param, at::MemoryFormat::Preserve));
    if (amsgrad) fresh->max_exp_avg_sq(at::zeros_like(param, at::MemoryFormat::Preserve));
    return fresh;
  });
  ParamStateView view;
  view.tensors = {{"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}};
  if (s.max_exp_avg_sq().defined()) view.tensors.emplace_back("max_exp_avg_sq", s.max_exp_avg_sq());
  view.step = at::full({}, s.step(), at::kLong);
  view.store_step = [&s, step = view.step] { s.step(step.item<int64_t>()); };
  view.read_step = [&s, step = view.step]() mutable { step.fill_(s.step()); };
  return view;
}

}  // namespace

ParamStateView param_state(torch::optim::Optimizer& optimizer, const at::Tensor& param) {
  const auto& options = optimizer.param_groups().at(0).options();
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer))
    return adam_like<torch::optim::AdamWParamState>(
        optimizer, param, static_cast<const torch::optim::AdamWOptions&>(options).amsgrad());
  if (dynamic_cast<torch::optim::Adam*>(&optimizer))
    return adam_like<torch::optim::AdamParamState>(
        optimizer, param, static_cast<const torch::optim::AdamOptions&>(options).amsgrad());
  if (dynamic_cast<torch::optim::SGD*>(&optimizer)) {
    const auto& sgd = static_cast<const torch::optim::SGDOptions&>(options);
    ParamStateView view;
    if (sgd.momentum() == 0) return view;
    auto& s = state_of<torch::optim::SGDParamState>(optimizer, param, [&] {
      DTRAIN_CHECK_ARG(sgd.dampening() == 0,
                       "checkpoint: an SGD optimizer with dampening has no momentum buffer before "
                       "its first step, and a zero one would change that step; save after a step");
      auto fresh = std::make_unique<torch::optim::SGDParamState>();
      fresh->momentum_buffer(at::zeros_like(param, at::MemoryFormat::Preserve));
      return fresh;
    });
    view.tensors = {{"momentum_buffer", s.momentum_buffer()}};
    return view;
  }
  throw InvalidArgument(dtrain::detail::cat(
      "checkpoint: optimizer state of ", typeid(optimizer).name(),
      " is not supported (Adam, AdamW and SGD are; a ZeroRedundancyOptimizer goes through add_zero)"));
}

}  // namespace dtrain::optim::detail
