// ColumnParallelLinear and RowParallelLinear (tensor_parallel.h).

#include <torch/nn/options/linear.h>
#include <torch/torch.h>

#include "common/enforce.h"
#include "dtrain/tensor_parallel.h"
#include "tensor_parallel/group.h"
#include "tensor_parallel/kept_outputs.h"
#include "tensor_parallel/kept_regions.h"
#include "tensor_parallel/layouts.h"

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

// `o` with its group resolved and its layouts checked (unset: the
// layer's defaults, `in` and `out`), at construction.
ParallelLinearOptions checked_options(ParallelLinearOptions o, const char* module, const Layout& in,
                                      detail::Takes in_takes, const Layout& out, detail::Takes out_takes) {
  o.group(detail::group_or_default(o.group(), module));
  o.input_layout(detail::checked_layout(o.input_layout(), in, in_takes, module, "input"));
  o.output_layout(detail::checked_layout(o.output_layout(), out, out_takes, module, "output"));
  return o;
}

ParallelLinearOptions column_options(const ParallelLinearOptions& o) {
  return checked_options(o, "ColumnParallelLinear", Replicate(), detail::Takes::kReplicateOrSequence,
                         Shard(-1), detail::Takes::kReplicateOrFeatures);
}

ParallelLinearOptions row_options(const ParallelLinearOptions& o) {
  return checked_options(o, "RowParallelLinear", Shard(-1), detail::Takes::kReplicateOrFeatures,
                         Replicate(), detail::Takes::kReplicateOrSequence);
}

bool replicated(const std::optional<Layout>& l) { return l->kind == Layout::Kind::kReplicate; }

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

}  // namespace

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in_features, int64_t out_features,
                                                   const ParallelLinearOptions& options)
    : ColumnParallelLinearImpl(whole_linear(in_features, out_features, options.bias()), options) {}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const torch::nn::Linear& full,
                                                   const ParallelLinearOptions& options)
    : options_(column_options(options)),
      in_(full->options.in_features()),
      out_(full->options.out_features()) {
  take_shard(full);
}

void ColumnParallelLinearImpl::take_shard(const torch::nn::Linear& full) {
  register_shard(*this, full, 0, options_, weight, bias, "ColumnParallelLinear");
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  const char* module = "ColumnParallelLinear";
  check_features(input, in_, module, "in_features");
  Layout in = *options_.input_layout();
  if (!replicated(in)) in = Shard(detail::sequence_dim_in(in, input, module, "input"));
  return forward_entered(enter_column_region(input, options_.group(), in));
}

at::Tensor ColumnParallelLinearImpl::forward_entered(const ColumnInput& input) {
  const char* module = "ColumnParallelLinear";
  const auto& g = options_.group();
  DTRAIN_CHECK_ARG(input.group() != nullptr, module, ": an input that enter_column_region did not make");
  DTRAIN_CHECK_ARG(input.group() == g, module, ": an input entered for group '", input.group()->name(),
                   "' where this layer's group is '", g->name(), "'");
  const auto& x = input.whole();
  Layout mine = *options_.input_layout();
  if (!replicated(mine)) mine = Shard(detail::sequence_dim_in(mine, x, module, "input"));
  DTRAIN_CHECK_ARG(input.layout() == mine, module, ": an input entered from ", input.layout().str(),
                   " where this layer's input layout is ", mine.str());
  check_features(x, in_, module, "in_features");
  auto out = dtrain::detail::checkpointed_linear(module, x, weight, bias);
  return replicated(options_.output_layout()) ? gather_from_region(out, g) : out;
}

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in_features, int64_t out_features,
                                             const ParallelLinearOptions& options)
    : RowParallelLinearImpl(whole_linear(in_features, out_features, options.bias()), options) {}

RowParallelLinearImpl::RowParallelLinearImpl(const torch::nn::Linear& full,
                                             const ParallelLinearOptions& options)
    : options_(row_options(options)),
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
  const char* module = "RowParallelLinear";
  const auto& g = options_.group();
  at::Tensor x = input;
  if (replicated(options_.input_layout())) {
    check_features(input, in_, module, "in_features");
    x = scatter_to_region(input, g);
  } else {
    check_features(input, in_ / g->size(), module,
                   "this rank's share of in_features, as its input layout Shard(-1) says");
  }
  // One matrix multiply for a selective checkpoint (kept_outputs.h): its
  // kept output is the reduced one, so the recomputation runs neither the
  // multiply nor the collective.
  dtrain::detail::MatmulSite site(module);
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  int64_t d = -1;  // the output's sequence dimension, when it is a shard
  if (!replicated(options_.output_layout())) {
    d = detail::sequence_dim_in(*options_.output_layout(), sizes, module, "output");
    DTRAIN_CHECK_ARG(sizes[d] % g->size() == 0, module, ": the sequence (dimension ", d, ", ", sizes[d],
                     ") does not split over the ", g->size(), " ranks of group '", g->name(), "'");
    sizes[d] /= g->size();
  }
  at::Tensor out = site.take_kept(sizes);
  if (out.defined()) {
    const auto partial = dtrain::detail::linear_never_read(x, weight, out.scalar_type());
    out = d < 0 ? detail::reduce_from_region_kept(partial, g, out)
                : detail::reduce_scatter_to_sequence_region_kept(partial, g, d, out);
  } else {
    const auto partial = dtrain::detail::folded_linear(x, weight, at::Tensor());
    out = d < 0 ? reduce_from_region(partial, g) : reduce_scatter_to_sequence_region(partial, g, d);
    site.offer(out);
  }
  if (!bias.defined()) return out;
  // A sequence shard of the sum meets the bias (whole on every rank) in
  // this shard's rows only: its gradient is summed over the group
  // (copy_to_region) to be the whole sequence's.
  return d < 0 ? out + bias : out + copy_to_region(bias, g);
}

}  // namespace dtrain::tensor_parallel
