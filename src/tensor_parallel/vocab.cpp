// VocabParallelEmbedding and vocab_parallel_cross_entropy
// (tensor_parallel.h).

#include <torch/torch.h>

#include "common/enforce.h"
#include "dtrain/tensor_parallel.h"
#include "tensor_parallel/group.h"
#include "tensor_parallel/layouts.h"

namespace dtrain::tensor_parallel {
namespace {

// A copy of `t` summed over the group, outside autograd.
at::Tensor summed_quietly(ProcessGroup& g, const at::Tensor& t, ReduceOp op) {
  auto out = t.detach().contiguous().clone();
  g.all_reduce(out, op)->wait();
  return out;
}

}  // namespace

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t num_embeddings,
                                                       int64_t embedding_dim,
                                                       const ParallelLinearOptions& options)
    : VocabParallelEmbeddingImpl(torch::nn::Embedding(num_embeddings, embedding_dim), options) {}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const torch::nn::Embedding& full,
                                                       const ParallelLinearOptions& options)
    : options_(options), num_(full->options.num_embeddings()) {
  const char* module = "VocabParallelEmbedding";
  options_.group(detail::group_or_default(options.group(), module));
  DTRAIN_CHECK_ARG(!options.input_layout() || *options.input_layout() == Replicate(), module,
                   ": input layout ", options.input_layout() ? options.input_layout()->str() : "",
                   ": its input, the ids, is whole on every rank (Replicate())");
  options_.output_layout(detail::checked_layout(options.output_layout(), Replicate(),
                                                detail::Takes::kReplicateOrSequence, module, "output"));
  take_shard(full);
}

void VocabParallelEmbeddingImpl::take_shard(const torch::nn::Embedding& full) {
  auto& g = *options_.group();
  DTRAIN_CHECK_ARG(num_ > 0 && num_ % g.size() == 0, "VocabParallelEmbedding: num_embeddings (",
                   num_, ") does not split over the ", g.size(), " ranks of group '", g.name(),
                   "'");
  const int64_t part = num_ / g.size();
  first_ = g.rank() * part;
  torch::NoGradGuard no_grad;
  weight = register_parameter("weight", full->weight.narrow(0, first_, part).clone());
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  DTRAIN_CHECK_ARG(!ids.is_floating_point() && !ids.is_complex(),
                   "VocabParallelEmbedding: ids must be integers, got ", ids.scalar_type());
  if (ids.numel() > 0) {
    const auto lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    DTRAIN_CHECK_ARG(lo >= 0 && hi < num_, "VocabParallelEmbedding: ids must be in [0, ", num_,
                     "), got ", lo < 0 ? lo : hi);
  }
  const int64_t part = weight.size(0);
  const auto mine = (ids >= first_) & (ids < first_ + part);
  // Ids of other ranks look up row 0 and are zeroed, so that their rows
  // get no gradient here.
  const auto local = at::where(mine, ids - first_, at::zeros_like(ids));
  auto rows = torch::embedding(weight, local) * mine.unsqueeze(-1).to(weight.scalar_type());
  const Layout& out = *options_.output_layout();
  if (out.kind == Layout::Kind::kReplicate) return reduce_from_region(rows, options_.group());
  // Sequence parallel: this rank's sequence shard of the summed lookups.
  return reduce_scatter_to_sequence_region(
      rows, options_.group(), detail::sequence_dim_in(out, rows, "VocabParallelEmbedding", "output"));
}

std::vector<ParameterPlacement> VocabParallelEmbeddingImpl::parameter_placements() const {
  return {{"weight", {num_, weight.size(1)}, {first_, 0}}};
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits_shard, const at::Tensor& target,
                                        const std::shared_ptr<ProcessGroup>& group,
                                        const torch::nn::CrossEntropyLossOptions& options) {
  const char* what = "vocab_parallel_cross_entropy";
  auto g = detail::group_or_default(group, what);
  DTRAIN_CHECK_ARG(logits_shard.dim() == 2 && target.dim() == 1 &&
                       target.size(0) == logits_shard.size(0),
                   what, ": logits [N, V / t] and target [N], got ", logits_shard.sizes(), " and ",
                   target.sizes());
  DTRAIN_CHECK_ARG(!options.weight().defined(), what,
                   ": class weights (CrossEntropyLossOptions::weight) are not supported");
  const double smoothing = options.label_smoothing();
  DTRAIN_CHECK_ARG(smoothing >= 0 && smoothing <= 1, what, ": label_smoothing must be in [0, 1], got ",
                   smoothing);
  const int64_t part = logits_shard.size(1), vocab = part * g->size();
  const int64_t first = g->rank() * part;
  const auto kept = target != options.ignore_index();
  const auto counted = target.masked_select(kept);
  if (counted.numel() > 0) {
    const auto lo = counted.min().item<int64_t>(), hi = counted.max().item<int64_t>();
    DTRAIN_CHECK_ARG(lo >= 0 && hi < vocab, what, ": targets must be in [0, ", vocab, ") or ignore_index ",
                     options.ignore_index(), " (", part, " logits on each of the ", g->size(),
                     " ranks of group '", g->name(), "'), got ", lo < 0 ? lo : hi);
  }
  // Shifted by the row's maximum over every rank (a constant for autograd).
  const auto row_max = summed_quietly(*g, std::get<0>(logits_shard.max(1)), ReduceOp::MAX);
  const auto shifted = logits_shard - row_max.unsqueeze(1);
  // The sum of exponentials and the target's logit, each summed over the
  // ranks by a region whose backward is the identity: each rank's gradient
  // is then its slice of softmax - one_hot.
  const auto log_sum_exp = reduce_from_region(shifted.exp().sum(1), g).log();
  const auto mine = kept & (target >= first) & (target < first + part);
  const auto local = at::where(mine, target - first, at::zeros_like(target));
  const auto picked = shifted.gather(1, local.unsqueeze(1)).squeeze(1) *
                      mine.to(shifted.scalar_type());
  const auto weight = kept.to(shifted.scalar_type());
  auto loss = (log_sum_exp - reduce_from_region(picked, g)) * weight;
  if (smoothing > 0) {
    // The uniform target's part: -mean_j log p_ij = log sum exp - mean_j
    // of the shifted logits over the whole vocabulary.
    const auto uniform = (log_sum_exp - reduce_from_region(shifted.sum(1), g) / vocab) * weight;
    loss = (1 - smoothing) * loss + smoothing * uniform;
  }
  const std::string reduction = torch::enumtype::get_enum_name(options.reduction());
  if (reduction == "kNone") return loss;
  if (reduction == "kSum") return loss.sum();
  return loss.sum() / weight.sum();  // the mean over the rows counted (NaN if none, as PyTorch's)
}

}  // namespace dtrain::tensor_parallel
