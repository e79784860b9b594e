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

// Sequence parallelism's constraints (tensor_parallel.h), at construction.
void check_sequence_options(const ParallelLinearOptions& o, const char* module) {
  if (!o.sequence_parallel()) return;
  DTRAIN_CHECK_ARG(!o.gather_output(), module, ": gather_output with sequence_parallel (the output "
                   "is this rank's features of the whole sequence; gather it yourself if needed)");
  DTRAIN_CHECK_ARG(o.input_is_parallel(), module, ": sequence_parallel needs input_is_parallel "
                   "(its input is this rank's features of the whole sequence)");
}

// `o` with its group resolved, checked at construction.
ParallelLinearOptions checked_options(ParallelLinearOptions o, const char* module) {
  o.group(detail::group_or_default(o.group(), module));
  check_sequence_options(o, module);
  return o;
}

// Registers this rank's part of `full` as `weight` and `bias` of `m`: the
// weight's rows (dim 0, a column-parallel layer) or columns (dim 1, a
// row-parallel one), and the bias split with the rows or whole. Without a
// bias to take, o.bias() turns false.
void register_shard(torch::nn::Module& m, const torch::nn::Linear& full, int64_t dim,
                    ParallelLinearOptions& o, at::Tensor& weight, at::Tensor& bias,
                    const char* module) {
  const auto& g = *o.group();
  const int64_t part = shard_size(full->weight.size(dim), g, module, dim == 0 ? "out_features" : "in_features");
  torch::NoGradGuard no_grad;
  weight = m.register_parameter("weight", full->weight.narrow(dim, g.rank() * part, part).clone());
  if (o.bias() && full->bias.defined())
    bias = m.register_parameter("bias", (dim == 0 ? full->bias.narrow(0, g.rank() * part, part) : full->bias).clone());
  else
    o.bias(false);
}

// options.sequence_dim() for `x`, checked.
int64_t sequence_dim_of(const at::Tensor& x, const ParallelLinearOptions& o, const char* module) {
  const int64_t d = o.sequence_dim() < 0 ? o.sequence_dim() + x.dim() : o.sequence_dim();
  DTRAIN_CHECK_ARG(d >= 0 && d < x.dim() - 1, module, ": sequence_dim ", o.sequence_dim(),
                   " of an input of shape ", x.sizes(), " (the last dimension is the features)");
  return d;
}

}  // namespace

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in_features, int64_t out_features,
                                                   const ParallelLinearOptions& options)
    : ColumnParallelLinearImpl(whole_linear(in_features, out_features, options.bias()), options) {}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const torch::nn::Linear& full,
                                                   const ParallelLinearOptions& options)
    : options_(checked_options(options, "ColumnParallelLinear")),
      in_(full->options.in_features()),
      out_(full->options.out_features()) {
  take_shard(full);
}

void ColumnParallelLinearImpl::take_shard(const torch::nn::Linear& full) {
  register_shard(*this, full, 0, options_, weight, bias, "ColumnParallelLinear");
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  check_features(input, in_, "ColumnParallelLinear", "in_features");
  const auto& g = options_.group();
  // Sequence parallel: this rank's sequence shard, gathered whole.
  const auto x = options_.sequence_parallel()
                     ? gather_from_sequence_region(
                           input, g, sequence_dim_of(input, options_, "ColumnParallelLinear"))
                     : copy_to_region(input, g);
  auto out = torch::nn::functional::linear(x, weight, bias);
  return options_.gather_output() ? gather_from_region(out, g) : out;
}

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in_features, int64_t out_features,
                                             const ParallelLinearOptions& options)
    : RowParallelLinearImpl(whole_linear(in_features, out_features, options.bias()), options) {}

RowParallelLinearImpl::RowParallelLinearImpl(const torch::nn::Linear& full,
                                             const ParallelLinearOptions& options)
    : options_(checked_options(options, "RowParallelLinear")),
      in_(full->options.in_features()),
      out_(full->options.out_features()) {
  take_shard(full);
}

void RowParallelLinearImpl::take_shard(const torch::nn::Linear& full) {
  register_shard(*this, full, 1, options_, weight, bias, "RowParallelLinear");
}

std::vector<ParameterPlacement> ColumnParallelLinearImpl::parameter_placements() const {
  const int64_t part = weight.size(0), first = options_.group()->rank() * part;
  std::vector<ParameterPlacement> placed{{"weight", {out_, in_}, {first, 0}}};
  if (bias.defined()) placed.push_back({"bias", {out_}, {first}});
  return placed;
}

std::vector<ParameterPlacement> RowParallelLinearImpl::parameter_placements() const {
  const int64_t part = weight.size(1);
  return {{"weight", {out_, in_}, {0, options_.group()->rank() * part}}};
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  const auto& g = options_.group();
  const int64_t part = in_ / g->size();
  int64_t d = 0;  // the sequence dimension, under sequence parallelism
  if (options_.sequence_parallel()) {
    d = sequence_dim_of(input, options_, "RowParallelLinear");
    DTRAIN_CHECK_ARG(input.size(d) % g->size() == 0, "RowParallelLinear: the sequence (dimension ",
                     d, ", ", input.size(d), ") does not split over the ", g->size(),
                     " ranks of group '", g->name(), "'");
  }
  at::Tensor x = input;
  if (options_.input_is_parallel()) {
    check_features(input, part, "RowParallelLinear",
                "this rank's share of in_features, as input_is_parallel says");
  } else {
    check_features(input, in_, "RowParallelLinear", "in_features");
    x = scatter_to_region(input, g);
  }
  const auto partial = torch::nn::functional::linear(x, weight);
  if (!options_.sequence_parallel()) {
    const auto out = reduce_from_region(partial, g);
    return bias.defined() ? out + bias : out;
  }
  // This rank's sequence shard of the sum. The bias, whole on every rank,
  // then meets only this shard's rows: its gradient is summed over the
  // group (copy_to_region) to be the whole sequence's.
  const auto out = reduce_scatter_to_sequence_region(partial, g, d);
  return bias.defined() ? out + copy_to_region(bias, g) : out;
}

}  // namespace dtrain::tensor_parallel
