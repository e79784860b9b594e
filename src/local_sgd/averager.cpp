// Post-local SGD: PeriodicModelAverager, PostLocalSGDOptimizer and
// post_local_sgd_hook (dtrain/local_sgd.h), PyTorch's semantics.

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "common/enforce.h"
#include "dtrain/distributed.h"
#include "dtrain/local_sgd.h"
#include "local_sgd/flat.h"

namespace dtrain::local_sgd {

PeriodicModelAverager::PeriodicModelAverager(int64_t period, int64_t warmup_steps,
                                             std::shared_ptr<ProcessGroup> group)
    : period_(period), warmup_steps_(warmup_steps) {
  DTRAIN_CHECK_ARG(period >= 1, "PeriodicModelAverager: period must be at least 1, got ", period);
  DTRAIN_CHECK_ARG(warmup_steps >= 0, "PeriodicModelAverager: warmup_steps must not be negative, got ",
                   warmup_steps);
  group_ = group ? std::move(group) : default_group();
}

void PeriodicModelAverager::set_step(int64_t step) {
  DTRAIN_CHECK_ARG(step >= 0, "PeriodicModelAverager: step must not be negative, got ", step);
  step_ = step;
}

// PyTorch's average_parameters: the parameters that have a gradient,
// flattened, divided by the group's size, summed over it, copied back.
void PeriodicModelAverager::average_parameters(const std::vector<at::Tensor>& params) {
  const bool due = step_ >= warmup_steps_ && (step_ - warmup_steps_) % period_ == 0;
  ++step_;
  if (!due || group_->size() == 1) return;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> chosen;
  for (const auto& p : params)
    if (p.defined() && p.grad().defined()) chosen.push_back(p);
  if (chosen.empty()) return;
  for (const auto& p : chosen)
    DTRAIN_CHECK_ARG(p.scalar_type() == chosen[0].scalar_type() && p.device() == chosen[0].device(),
                     "PeriodicModelAverager: the parameters must share one dtype and device (", p.scalar_type(),
                     " on ", p.device(), " beside ", chosen[0].scalar_type(), " on ", chosen[0].device(), ")");
  at::Tensor all = detail::flat_of(chosen);
  all.div_(static_cast<double>(group_->size()));
  group_->all_reduce(all, ReduceOp::SUM)->wait();
  detail::copy_into(chosen, all);
}

PostLocalSGDOptimizer::PostLocalSGDOptimizer(torch::optim::Optimizer& optimizer, PeriodicModelAverager& averager)
    : optimizer_(optimizer), averager_(averager) {}

void PostLocalSGDOptimizer::step() {
  optimizer_.step();
  std::vector<at::Tensor> params;
  for (const auto& group : optimizer_.param_groups())
    params.insert(params.end(), group.params().begin(), group.params().end());
  averager_.average_parameters(params);
}

void PostLocalSGDOptimizer::zero_grad() { optimizer_.zero_grad(); }

// The state lives in the hook; DDP counts its synchronized backwards in
// bucket.iteration, which is PyTorch's state.iter.
CommHook post_local_sgd_hook(const PostLocalSGDState& state) {
  DTRAIN_CHECK_ARG(state.start_local_sgd_iter() >= 0,
                   "post_local_sgd_hook: start_local_sgd_iter must not be negative, got ",
                   state.start_local_sgd_iter());
  return [state](ProcessGroup& group, GradBucket& bucket) {
    ProcessGroup* over = &group;
    double divisor = bucket.divisor;
    if (bucket.iteration >= state.start_local_sgd_iter()) {
      if (!state.post_local_gradient_allreduce()) return;  // each replica's own gradient
      DTRAIN_CHECK_ARG(state.subgroup() != nullptr, "post_local_sgd_hook: local SGD started at backward ",
                       bucket.iteration, " with post_local_gradient_allreduce but no subgroup to average "
                       "over (give PostLocalSGDState a subgroup, or turn it off)");
      over = state.subgroup().get();
      divisor = over->size();
    }
    bucket.buffer.div_(divisor);
    over->all_reduce(bucket.buffer, ReduceOp::SUM)->wait();
  };
}

}  // namespace dtrain::local_sgd
