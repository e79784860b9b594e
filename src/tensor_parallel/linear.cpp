// ColumnParallelLinear and RowParallelLinear (tensor_parallel.h).

#include <torch/nn/functional/linear.h>
#include <torch/nn/options/linear.h>
#include <torch/torch.h>

#include "common/enforce.h"
#include "dtrain/tensor_parallel.h"
#include "tensor_parallel/group.h"

namespace dtrain::tensor_parallel {
namespace {

// The features a rank holds of `features` split over `g`.
int64_t shard_size(int64_t features, const ProcessGroup& g, const char* module, const char* what) {
  DTRAIN_CHECK_ARG(features > 0 && features % g.size() == 0, module, ": ", what, " (", features,
                   ") does not split over the ", g.size(), " ranks of group '", g.name(), "'");
  return features / g.size();
}

torch::nn::Linear whole_linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

void check_features(const at::Tensor& input, int64_t features, const char* module,
                 const char* expected) {
  DTRAIN_CHECK_ARG(input.dim() >= 1 && input.size(-1) == features, module, ": the input's last "
                   "dimension is ", input.dim() >= 1 ? input.size(-1) : 0, ", expected ", features,
                   " (", expected, ")");
}

}  // namespace

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in_features, int64_t out_features,
                                                   const ParallelLinearOptions& options)
    : ColumnParallelLinearImpl(whole_linear(in_features, out_features, options.bias()), options) {}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const torch::nn::Linear& full,
                                                   const ParallelLinearOptions& options)
    : options_(options), in_(full->options.in_features()), out_(full->options.out_features()) {
  options_.group(detail::group_or_default(options.group(), "ColumnParallelLinear"));
  take_shard(full);
}

void ColumnParallelLinearImpl::take_shard(const torch::nn::Linear& full) {
  auto& g = *options_.group();
  const int64_t part = shard_size(out_, g, "ColumnParallelLinear", "out_features");
  torch::NoGradGuard no_grad;
  weight = register_parameter("weight", full->weight.narrow(0, g.rank() * part, part).clone());
  if (options_.bias() && full->bias.defined())
    bias = register_parameter("bias", full->bias.narrow(0, g.rank() * part, part).clone());
  else
    options_.bias(false);
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  check_features(input, in_, "ColumnParallelLinear", "in_features");
  const auto& g = options_.group();
  auto out = torch::nn::functional::linear(copy_to_region(input, g), weight, bias);
  return options_.gather_output() ? gather_from_region(out, g) : out;
}

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in_features, int64_t out_features,
                                             const ParallelLinearOptions& options)
    : RowParallelLinearImpl(whole_linear(in_features, out_features, options.bias()), options) {}

RowParallelLinearImpl::RowParallelLinearImpl(const torch::nn::Linear& full,
                                             const ParallelLinearOptions& options)
    : options_(options), in_(full->options.in_features()), out_(full->options.out_features()) {
  options_.group(detail::group_or_default(options.group(), "RowParallelLinear"));
  take_shard(full);
}

void RowParallelLinearImpl::take_shard(const torch::nn::Linear& full) {
  auto& g = *options_.group();
  const int64_t part = shard_size(in_, g, "RowParallelLinear", "in_features");
  torch::NoGradGuard no_grad;
  weight = register_parameter("weight", full->weight.narrow(1, g.rank() * part, part).clone());
  if (options_.bias() && full->bias.defined())
    bias = register_parameter("bias", full->bias.clone());
  else
    options_.bias(false);
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  const auto& g = options_.group();
  const int64_t part = in_ / g->size();
  at::Tensor x = input;
  if (options_.input_is_parallel()) {
    check_features(input, part, "RowParallelLinear",
                "this rank's share of in_features, as input_is_parallel says");
  } else {
    check_features(input, in_, "RowParallelLinear", "in_features");
    x = scatter_to_region(input, g);
  }
  auto out = reduce_from_region(torch::nn::functional::linear(x, weight), g);
  return bias.defined() ? out + bias : out;
}

}  // namespace dtrain::tensor_parallel
