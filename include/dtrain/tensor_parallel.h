#pragma once

// Tensor parallelism (Megatron-style; PyTorch's ColwiseParallel and
// RowwiseParallel without DTensor): a Linear's weight split over the ranks
// of a tensor-parallel group, each rank computing its share, with the
// communication inside the modules as autograd functions.
//
//   namespace tp = dtrain::tensor_parallel;
//   auto g = mesh.get_group("tp");                       // or any group
//   tp::ColumnParallelLinear up(512, 2048, tp::ParallelLinearOptions().group(g));
//   tp::RowParallelLinear down(2048, 512, tp::ParallelLinearOptions().group(g));
//   auto y = down(torch::relu(up(x)));   // x and y whole on every rank
//
// ColumnParallelLinear(in, out) splits the weight along its output
// dimension: rank r holds rows [r out/t, (r+1) out/t) of the [out, in]
// weight (and that slice of the bias), and its output is that slice of the
// features (the last dimension), or all of them with gather_output.
// RowParallelLinear(in, out) splits it along its input dimension: rank r
// holds columns [r in/t, (r+1) in/t); its input is that slice of the
// features (input_is_parallel, as a ColumnParallelLinear leaves it) or the
// whole input, which it slices; the ranks' partial outputs are summed
// (all_reduce) and the whole bias added once. A column layer followed by a
// row layer, with any elementwise function between, costs one all_reduce
// forward and one backward.
//
// Built from sizes, a module holds rank r's shard of the torch::nn::Linear
// that the same sizes and the same seed would make in one process (every
// rank must seed alike); built from a Linear, it holds that Linear's shard,
// so a model trained in one process can be split. Its parameters are named
// weight and bias, as a Linear's.
//
// Every rank of the group runs the same forwards and backwards (the region
// operations are collectives). The group must outlive the backward passes
// through a module. See docs/tensor-parallel.md (what is not here yet:
// sequence parallelism, the plan form; activation checkpointing is in
// activation_checkpoint.h).

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>

#include "dtrain/arg.h"
#include "dtrain/process_group.h"

namespace dtrain::tensor_parallel {

struct ParallelLinearOptions {
  DTRAIN_ARG(bool, bias) = true;
  // ColumnParallelLinear: all-gather the output's feature shards, so that
  // every rank gets the whole output.
  DTRAIN_ARG(bool, gather_output) = false;
  // RowParallelLinear: the input is already this rank's slice of the
  // features (false: the whole input, sliced here).
  DTRAIN_ARG(bool, input_is_parallel) = true;
  // The tensor-parallel group; null: the default group.
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, group) = nullptr;
};

// The region operations, each an autograd function over `group`:
// copy_to_region: identity forward, all_reduce (sum) of the gradient
// backward (entering a column-parallel region); reduce_from_region:
// all_reduce forward, identity backward (leaving a row-parallel region);
// gather_from_region: all_gather along the last dimension forward, this
// rank's slice of the gradient backward; scatter_to_region: this rank's
// slice of the last dimension forward, all_gather of the gradient backward.
at::Tensor copy_to_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group);
at::Tensor reduce_from_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group);
at::Tensor gather_from_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group);
at::Tensor scatter_to_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group);

class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features,
                           const ParallelLinearOptions& options = ParallelLinearOptions());
  // This rank's shard of `full` (its bias too, if it has one and
  // options.bias() is true).
  ColumnParallelLinearImpl(const torch::nn::Linear& full,
                           const ParallelLinearOptions& options = ParallelLinearOptions());

  at::Tensor forward(const at::Tensor& input);

  const ParallelLinearOptions& options() const { return options_; }
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }  // the whole layer's

  at::Tensor weight;  // [out_features / t, in_features]
  at::Tensor bias;    // [out_features / t], or undefined

 private:
  void take_shard(const torch::nn::Linear& full);
  ParallelLinearOptions options_;
  int64_t in_, out_;
};
TORCH_MODULE(ColumnParallelLinear);

class RowParallelLinearImpl : public torch::nn::Module {
 public:
  RowParallelLinearImpl(int64_t in_features, int64_t out_features,
                        const ParallelLinearOptions& options = ParallelLinearOptions());
  RowParallelLinearImpl(const torch::nn::Linear& full,
                        const ParallelLinearOptions& options = ParallelLinearOptions());

  at::Tensor forward(const at::Tensor& input);

  const ParallelLinearOptions& options() const { return options_; }
  int64_t in_features() const { return in_; }  // the whole layer's
  int64_t out_features() const { return out_; }

  at::Tensor weight;  // [out_features, in_features / t]
  at::Tensor bias;    // [out_features], whole on every rank, or undefined

 private:
  void take_shard(const torch::nn::Linear& full);
  ParallelLinearOptions options_;
  int64_t in_, out_;
};
TORCH_MODULE(RowParallelLinear);

// An Embedding whose table is split along the vocabulary: rank r holds rows
// [r n/t, (r+1) n/t) of the [num_embeddings, embedding_dim] weight, looks up
// the ids in its range (zeros for the others), and the ranks' lookups are
// summed (one all_reduce forward). Its output is whole on every rank.
class VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim,
                             const ParallelLinearOptions& options = ParallelLinearOptions());
  // This rank's rows of `full`.
  VocabParallelEmbeddingImpl(const torch::nn::Embedding& full,
                             const ParallelLinearOptions& options = ParallelLinearOptions());

  at::Tensor forward(const at::Tensor& ids);

  int64_t num_embeddings() const { return num_; }  // the whole vocabulary
  int64_t first_id() const { return first_; }      // of this rank's rows

  at::Tensor weight;  // [num_embeddings / t, embedding_dim]

 private:
  void take_shard(const torch::nn::Embedding& full);
  ParallelLinearOptions options_;
  int64_t num_, first_ = 0;
};
TORCH_MODULE(VocabParallelEmbedding);

// PyTorch's loss_parallel: the mean cross-entropy of logits split along the
// vocabulary (the last dimension: this rank's [N, V/t] slice, as a
// ColumnParallelLinear without gather_output gives it) against targets
// [N] of ids in [0, V), without gathering the logits: the ranks exchange
// each row's maximum, its sum of exponentials and its target's logit (three
// all_reduces of N values). The loss is the same on every rank, and its
// gradient reaches each rank's logits as that slice of the whole softmax's.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits_shard, const at::Tensor& target,
                                        const std::shared_ptr<ProcessGroup>& group = nullptr);

}  // namespace dtrain::tensor_parallel
