// SyncBatchNorm: global batch statistics through one all_reduce in forward
// and one in backward, in an autograd node of its own (so the process group
// travels with the graph). Formulas, per channel over the global batch of n
// elements, xhat = (x - mean) * invstd, invstd = 1 / sqrt(var + eps):
//   forward   y  = xhat * w + b
//   backward  dx = (dy - sum(dy) / n - xhat * sum(dy * xhat) / n) * invstd * w
// with both sums global; dw = sum(dy * xhat) and db = sum(dy) over this
// rank's batch. The element-wise passes are BatchNorm's own CPU/CUDA
// kernels in eval mode, given the global statistics.

#include "dtrain/nn/sync_batch_norm.h"

#include <ATen/core/grad_mode.h>  // at::NoGradGuard (its own header on libtorch 2.x)
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/nn/module.h>

#include "common/enforce.h"
#include "common/torch_compat.h"
#include "dtrain/distributed.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

using torch::autograd::variable_list;

// Every dimension but the channels'.
std::vector<int64_t> reduced_dims(const at::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// A per-channel vector shaped to broadcast against `like`: (1, C, 1, ...).
at::Tensor per_channel(const at::Tensor& v, const at::Tensor& like) {
  std::vector<int64_t> shape(like.dim(), 1);
  shape[1] = v.numel();
  return v.to(like.scalar_type()).view(shape);
}

// Sums `t` over the group, on the group's control device.
at::Tensor all_reduce_sum(ProcessGroup& group, const at::Tensor& t) {
  auto on_group = t.to(group.control_device());
  group.all_reduce(on_group, ReduceOp::SUM)->wait();
  return on_group.to(t.device());
}

struct GlobalStats {
  at::Tensor mean;    // double, (C)
  at::Tensor var;     // biased, double, (C)
  double count = 0;   // elements per channel over the group
};

GlobalStats global_stats(ProcessGroup& group, const at::Tensor& input) {
  const auto dims = reduced_dims(input);
  const int64_t channels = input.size(1);
  const double local_count = channels == 0 ? 0.0 : static_cast<double>(input.numel() / channels);
  // This rank's sums, accumulated in double (cheaper on CPU than
  // var_mean's Welford pass over these dimensions).
  const auto sums = at::stack({input.sum(dims, false, at::kDouble),
                               input.square().sum(dims, false, at::kDouble)});
  auto fused = at::cat({sums.view({-1}), at::full({1}, local_count, sums.options())});
  fused = all_reduce_sum(group, fused);
  GlobalStats stats;
  stats.count = fused[2 * channels].item<double>();
  if (stats.count <= 1) {
    throw InvalidArgument(detail::cat(
        "SyncBatchNorm: expected more than 1 value per channel in training, got ",
        stats.count, " over the group's ", group.size(), " ranks (this rank's input: ",
        input.sizes(), ")"));
  }
  stats.mean = fused.slice(0, 0, channels) / stats.count;
  stats.var = (fused.slice(0, channels, 2 * channels) / stats.count - stats.mean.square()).clamp_min(0);
  return stats;
}

// Per-channel statistics as BatchNorm's kernels take them: in the input's
// dtype, the variance biased.
struct KernelStats {
  at::Tensor mean, var;
};

KernelStats kernel_stats(const GlobalStats& stats, const at::Tensor& like) {
  return {stats.mean.to(like.scalar_type()), stats.var.to(like.scalar_type())};
}

class SyncBatchNormBackward : public torch::autograd::Node {
 public:
  SyncBatchNormBackward(std::shared_ptr<ProcessGroup> group, const at::Tensor& input,
                        const at::Tensor& weight, GlobalStats stats, double eps)
      : group_(std::move(group)),
        input_(input, false),
        weight_(weight, false),
        stats_(std::move(stats)),
        eps_(eps) {}

  std::string name() const override { return "dtrain::SyncBatchNormBackward"; }

  variable_list apply(variable_list&& grads) override {
    const auto input = input_.unpack();
    const auto weight = weight_.unpack();
    const int64_t channels = input.size(1);
    // An unused output still joins the group's all_reduce, with zeros.
    const auto dy = grads[0].defined() ? grads[0] : at::zeros_like(input);
    // This rank's sum(dy) and sum(dy * xhat), xhat = (x - mean) * invstd:
    // the weight and bias gradients of BatchNorm's own backward in eval
    // mode with the global statistics, one fused pass.
    at::Tensor sum_dy_xhat, sum_dy;
    if (input.numel() == 0) {
      sum_dy_xhat = at::zeros({channels}, input.options());
      sum_dy = at::zeros({channels}, input.options());
    } else {
      const auto k = kernel_stats(stats_, input);
      const auto w = weight.defined() ? weight : at::ones({channels}, input.options());
      // (Eval mode reads the running statistics; the saved ones are passed
      // too, the same values, because the CUDA kernel asserts that they are
      // defined: "save_mean should always be defined", seen on an H200.)
      const auto save_invstd = (k.var + eps_).rsqrt();
      std::tie(std::ignore, sum_dy_xhat, sum_dy) = at::native_batch_norm_backward(
          dy, input, w, k.mean, k.var, k.mean, save_invstd, /*train=*/false, eps_, {false, true, true});
    }
    variable_list out(3);
    if (should_compute_output(0)) {
      const auto global = all_reduce_sum(
          *group_, at::cat({sum_dy.to(at::kDouble), sum_dy_xhat.to(at::kDouble)}));
      const auto mean_dy = global.slice(0, 0, channels) / stats_.count;
      const auto mean_dy_xhat = global.slice(0, channels, 2 * channels) / stats_.count;
      // dx = (dy - mean_dy - xhat * mean_dy_xhat) * invstd * w = a*dy + b*x + c
      const auto invstd = (stats_.var + eps_).rsqrt();
      const auto a = weight.defined() ? invstd * weight.to(at::kDouble) : invstd;
      const auto b = -a * invstd * mean_dy_xhat;
      const auto c = -a * mean_dy - b * stats_.mean;
      out[0] = at::addcmul(per_channel(c, input), input, per_channel(b, input));
      out[0].addcmul_(dy, per_channel(a, input));
    }
    if (should_compute_output(1)) out[1] = sum_dy_xhat.to(weight.scalar_type());
    if (should_compute_output(2)) out[2] = sum_dy.to(weight.scalar_type());
    return out;
  }

 private:
  void release_variables() override {
    input_.reset_data();
    weight_.reset_data();
  }

  std::shared_ptr<ProcessGroup> group_;
  torch::autograd::SavedVariable input_;
  torch::autograd::SavedVariable weight_;
  GlobalStats stats_;
  double eps_;
};

// y = (x - mean) / sqrt(var + eps) * w + b with the global statistics
// (BatchNorm's eval-mode kernel), recorded for autograd as one node.
at::Tensor normalize(const std::shared_ptr<ProcessGroup>& group, const at::Tensor& input,
                     const at::Tensor& weight, const at::Tensor& bias, const GlobalStats& stats,
                     double eps) {
  at::Tensor output;
  {
    at::NoGradGuard no_grad;
    const auto k = kernel_stats(stats, input);
    output = input.numel() == 0
                 ? at::empty_like(input)
                 : std::get<0>(at::native_batch_norm(input, weight, bias, k.mean, k.var,
                                                     /*training=*/false, 0.0, eps));
  }
  if (torch::autograd::compute_requires_grad(input, weight, bias)) {
    auto node = compat::make_node<SyncBatchNormBackward>(group, input, weight, stats, eps);
    node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias));
    torch::autograd::set_history(output, node);
  }
  return output;
}

void check_input(size_t dims, int64_t features, const at::Tensor& input) {
  const bool dim_ok = dims == 1 ? (input.dim() == 2 || input.dim() == 3)
                                : input.dim() == static_cast<int64_t>(dims) + 2;
  if (!dim_ok) {
    throw InvalidArgument(detail::cat(
        "SyncBatchNorm", dims, "d: expected ",
        dims == 1 ? "2D or 3D" : std::to_string(dims + 2) + "D", " input, got ", input.dim(),
        "D input of shape ", input.sizes()));
  }
  if (input.size(1) != features) {
    throw InvalidArgument(detail::cat("SyncBatchNorm", dims, "d: expected ", features,
                                      " channels (dim 1), got input of shape ", input.sizes()));
  }
}

// The group a training forward synchronizes over; null: run locally (no
// default group, as PyTorch without torch.distributed initialized, or a
// group of one rank).
std::shared_ptr<ProcessGroup> sync_group(const std::shared_ptr<ProcessGroup>& own) {
  auto group = own;
  if (!group) {
    if (!is_initialized()) return nullptr;
    group = default_group();
  }
  if (group->rank() < 0) {
    throw InvalidArgument(
        "SyncBatchNorm: this rank is not a member of the module's process group");
  }
  return group->size() > 1 ? group : nullptr;
}

}  // namespace

template <size_t D>
SyncBatchNormImpl<D>::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options,
                                        std::shared_ptr<ProcessGroup> group)
    : SyncBatchNormImpl(options, std::move(group), nullptr) {}

template <size_t D>
SyncBatchNormImpl<D>::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options,
                                        std::shared_ptr<ProcessGroup> group,
                                        std::shared_ptr<Adopted> adopted)
    : options(options), group(std::move(group)), adopted_(std::move(adopted)) {
  reset();
}

template <size_t D>
std::shared_ptr<SyncBatchNormImpl<D>> SyncBatchNormImpl<D>::adopting(
    const torch::nn::BatchNormOptions& options, std::shared_ptr<ProcessGroup> group,
    const torch::nn::Module& norm) {
  auto adopted = std::make_shared<Adopted>();
  const auto params = norm.named_parameters(false);
  const auto buffers = norm.named_buffers(false);
  auto param = [&](const char* name) {
    const auto* t = params.find(name);
    return t ? *t : torch::Tensor();
  };
  auto buffer = [&](const char* name) {
    const auto* t = buffers.find(name);
    return t ? *t : torch::Tensor();
  };
  adopted->weight = param("weight");
  adopted->bias = param("bias");
  adopted->running_mean = buffer("running_mean");
  adopted->running_var = buffer("running_var");
  adopted->num_batches_tracked = buffer("num_batches_tracked");
  std::shared_ptr<SyncBatchNormImpl> module(
      new SyncBatchNormImpl(options, std::move(group), std::move(adopted)));
  module->train(norm.is_training());
  return module;
}

template <size_t D>
void SyncBatchNormImpl<D>::reset() {
  const auto features = options.num_features();
  const auto adopted = std::exchange(adopted_, nullptr);
  if (options.affine()) {
    weight = this->register_parameter("weight", adopted ? adopted->weight : at::ones({features}));
    bias = this->register_parameter("bias", adopted ? adopted->bias : at::zeros({features}));
  } else {
    weight = this->register_parameter("weight", torch::Tensor(), false);
    bias = this->register_parameter("bias", torch::Tensor(), false);
  }
  if (options.track_running_stats()) {
    running_mean = this->register_buffer(
        "running_mean", adopted ? adopted->running_mean : at::zeros({features}));
    running_var = this->register_buffer(
        "running_var", adopted ? adopted->running_var : at::ones({features}));
    num_batches_tracked = this->register_buffer(
        "num_batches_tracked",
        adopted ? adopted->num_batches_tracked : at::zeros({}, at::kLong));
  } else {
    running_mean = this->register_buffer("running_mean", torch::Tensor());
    running_var = this->register_buffer("running_var", torch::Tensor());
    num_batches_tracked = this->register_buffer("num_batches_tracked", torch::Tensor());
  }
}

template <size_t D>
void SyncBatchNormImpl<D>::reset_running_stats() {
  if (!options.track_running_stats()) return;
  at::NoGradGuard no_grad;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

template <size_t D>
void SyncBatchNormImpl<D>::reset_parameters() {
  reset_running_stats();
  if (!options.affine()) return;
  at::NoGradGuard no_grad;
  weight.fill_(1);
  bias.zero_();
}

template <size_t D>
torch::Tensor SyncBatchNormImpl<D>::forward(const torch::Tensor& input) {
  check_input(D, options.num_features(), input);
  // BatchNorm's running-average factor: momentum, or 1/batches when unset.
  double factor = options.momentum().value_or(0.0);
  const bool tracking = options.track_running_stats() && num_batches_tracked.defined();
  if (this->is_training() && tracking) {
    at::NoGradGuard no_grad;
    num_batches_tracked += 1;
    if (!options.momentum()) factor = 1.0 / num_batches_tracked.template item<double>();
  }
  const auto group = this->is_training() ? sync_group(this->group) : nullptr;
  if (!group) {
    return at::batch_norm(input, weight, bias, running_mean, running_var,
                             this->is_training() || !options.track_running_stats(), factor,
                             options.eps(), at::globalContext().userEnabledCuDNN());
  }
  const auto stats = global_stats(*group, input);
  if (tracking) {
    at::NoGradGuard no_grad;
    const auto unbiased = stats.var * (stats.count / (stats.count - 1));
    running_mean.mul_(1 - factor).add_(stats.mean.to(running_mean.scalar_type()), factor);
    running_var.mul_(1 - factor).add_(unbiased.to(running_var.scalar_type()), factor);
  }
  return normalize(group, input, weight, bias, stats, options.eps());
}

template <size_t D>
void SyncBatchNormImpl<D>::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "dtrain::SyncBatchNorm" << D << "d(" << options.num_features()
         << ", eps=" << options.eps() << ", momentum=";
  if (options.momentum())
    stream << *options.momentum();
  else
    stream << "None";
  stream << ", affine=" << options.affine()
         << ", track_running_stats=" << options.track_running_stats() << ")";
}

template class SyncBatchNormImpl<1>;
template class SyncBatchNormImpl<2>;
template class SyncBatchNormImpl<3>;

}  // namespace dtrain
