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
// features (the last dimension), or all of them (output layout
// Replicate()).
// RowParallelLinear(in, out) splits it along its input dimension: rank r
// holds columns [r in/t, (r+1) in/t); its input is that slice of the
// features (input layout Shard(-1), as a ColumnParallelLinear leaves it) or
// the whole input (Replicate()), which it slices; the ranks' partial outputs are summed
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
// through a module. The plan form, parallelize_module, rebuilds a
// Sequential. See docs/tensor-parallel.md (activation checkpointing is in
// activation_checkpoint.h).

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/options/loss.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "dtrain/arg.h"
#include "dtrain/parameter_placement.h"
#include "dtrain/process_group.h"

namespace dtrain::tensor_parallel {

// How an activation lies over the ranks of a tensor-parallel group, as
// PyTorch's placements say it: Replicate() is whole on every rank;
// Shard(dim) is split evenly along dim, rank r holding the r-th part. The
// last dimension (-1) is the features; any other is the sequence (1 in
// [batch, sequence, ...], PyTorch's; 0 in Megatron's [sequence, batch,
// ...]), and a layer whose input or output is sharded on the sequence
// runs sequence parallelism (Megatron's SP; PyTorch's SequenceParallel
// between ColwiseParallel and RowwiseParallel). A negative dim counts from
// the end of the tensor the layer meets.
struct Layout {
  enum class Kind { kReplicate, kShard };
  Kind kind = Kind::kReplicate;
  int64_t dim = 0;  // Shard's
  bool operator==(const Layout& other) const {
    return kind == other.kind && (kind == Kind::kReplicate || dim == other.dim);
  }
  bool operator!=(const Layout& other) const { return !(*this == other); }
  std::string str() const;  // "Replicate()", "Shard(1)"
};
inline Layout Replicate() { return Layout{}; }
inline Layout Shard(int64_t dim) { return Layout{Layout::Kind::kShard, dim}; }

// Each layer's input and output layouts (unset: the layer's default), and
// what the layer does for them; a layout not listed is an InvalidArgument
// naming it.
//  ColumnParallelLinear, input: Replicate() (default; its gradient is
//    summed over the group in backward), or Shard(sequence): all-gathered
//    along the sequence, its gradient reduce-scattered. Output: Shard(-1)
//    (default; this rank's features) or Replicate() (the features
//    all-gathered).
//  RowParallelLinear, input: Shard(-1) (default; this rank's features, as
//    a column layer leaves them) or Replicate() (sliced here). Output:
//    Replicate() (default; the ranks' partial sums all-reduced) or
//    Shard(sequence) (reduce-scattered along the sequence; the bias, whole
//    on every rank, then meets only this rank's rows and its gradient is
//    summed over the group).
//  VocabParallelEmbedding, output: Replicate() (default; all-reduced) or
//    Shard(sequence) (reduce-scattered); its input, the ids, is whole.
struct ParallelLinearOptions {
  DTRAIN_ARG(bool, bias) = true;
  // The tensor-parallel group; null: the default group.
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, group) = nullptr;
  DTRAIN_ARG(std::optional<Layout>, input_layout) = std::nullopt;
  DTRAIN_ARG(std::optional<Layout>, output_layout) = std::nullopt;
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

// Sequence parallelism's region operations, along dimension `dim` (the
// sequence), which must split evenly over the group:
// scatter_to_sequence_region: this rank's slice forward, all_gather of the
// gradient backward (where a whole sequence enters the split region);
// gather_from_sequence_region: all_gather forward, reduce_scatter (sum) of
// the gradient backward (into a column-parallel layer, whose ranks each
// hold part of the input's gradient); reduce_scatter_to_sequence_region:
// reduce_scatter (sum) forward, all_gather of the gradient backward (out
// of a row-parallel layer).
at::Tensor scatter_to_sequence_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group,
                                      int64_t dim = 1);
at::Tensor gather_from_sequence_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group,
                                       int64_t dim = 1);
at::Tensor reduce_scatter_to_sequence_region(const at::Tensor& x,
                                             const std::shared_ptr<ProcessGroup>& group,
                                             int64_t dim = 1);

// For a module that runs on sequence shards between sequence-parallel
// layers (a LayerNorm or RMSNorm, whose weights are whole on every rank):
// each of its parameters' gradients is summed over `group` as it arrives
// (a hook on the parameter), so that every rank gets the gradient of the
// whole sequence, as PyTorch's SequenceParallel and Megatron's
// sequence-parallel norms do. Marking a parameter again for the same group
// does nothing; for another group it is an InvalidArgument. Returns the
// number of parameters newly marked.
int64_t mark_sequence_parallel(torch::nn::Module& module,
                               const std::shared_ptr<ProcessGroup>& group = nullptr);

// The same sum in one all_reduce for several parameters together (the
// norms of a block under SP: Megatron reduces its layernorm gradients
// bucketed, not one call each): returns `params` themselves (the forward
// is the identity), to use in their place in this forward; in backward,
// once every one of them has its gradient, the gradients are flattened
// into one buffer, summed over `group` in one call, and handed on (to
// their .grad, and to DDP's or FSDP's reduction after it). Call it in each
// forward where the parameters are used (for FSDP, inside the unit that
// holds them); do not also mark them. A parameter this forward does not
// use gets no gradient, as without it. Every rank calls it alike.
std::vector<at::Tensor> sum_gradients_together(const std::vector<at::Tensor>& params,
                                               const std::shared_ptr<ProcessGroup>& group = nullptr);

// An activation entered once into the region of several
// ColumnParallelLinear layers that read it (q, k and v; gate and up): its
// all-gather (Shard(sequence)) runs once, not once per layer, and in
// backward the layers' gradients of it are summed here first and reduced
// in one call (one reduce-scatter; for Replicate() one all_reduce).
// Megatron fuses such layers' weights for this; PyTorch's
// PrepareModuleInput(desired_input_layouts=Replicate()) does it with
// DTensors. Pass it to each layer's forward_entered, whose input layout
// and group must be the ones it was entered with.
class ColumnInput {
 public:
  const at::Tensor& whole() const { return whole_; }  // the input as every rank now holds it
  const Layout& layout() const { return layout_; }    // entered from (its dim resolved)
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }

 private:
  friend ColumnInput enter_column_region(const at::Tensor&, const std::shared_ptr<ProcessGroup>&,
                                         const Layout&);
  at::Tensor whole_;
  Layout layout_;
  std::shared_ptr<ProcessGroup> group_;
};
ColumnInput enter_column_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group,
                                const Layout& layout = Replicate());

class ColumnParallelLinearImpl : public torch::nn::Module, public ShardedParameters {
 public:
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features,
                           const ParallelLinearOptions& options = ParallelLinearOptions());
  // This rank's shard of `full` (its bias too, if it has one and
  // options.bias() is true).
  ColumnParallelLinearImpl(const torch::nn::Linear& full,
                           const ParallelLinearOptions& options = ParallelLinearOptions());

  at::Tensor forward(const at::Tensor& input);
  // The layer on an input entered once for several layers
  // (enter_column_region): the entry's communication not repeated; its
  // output as forward's (features gathered for output Replicate()).
  at::Tensor forward_entered(const ColumnInput& input);
  // weight (and bias): rows [r out/t, (r+1) out/t) of the whole layer's.
  std::vector<ParameterPlacement> parameter_placements() const override;

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

class RowParallelLinearImpl : public torch::nn::Module, public ShardedParameters {
 public:
  RowParallelLinearImpl(int64_t in_features, int64_t out_features,
                        const ParallelLinearOptions& options = ParallelLinearOptions());
  RowParallelLinearImpl(const torch::nn::Linear& full,
                        const ParallelLinearOptions& options = ParallelLinearOptions());

  at::Tensor forward(const at::Tensor& input);
  // weight: columns [r in/t, (r+1) in/t) of the whole layer's (the bias is
  // whole).
  std::vector<ParameterPlacement> parameter_placements() const override;

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
class VocabParallelEmbeddingImpl : public torch::nn::Module, public ShardedParameters {
 public:
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim,
                             const ParallelLinearOptions& options = ParallelLinearOptions());
  // This rank's rows of `full`.
  VocabParallelEmbeddingImpl(const torch::nn::Embedding& full,
                             const ParallelLinearOptions& options = ParallelLinearOptions());

  at::Tensor forward(const at::Tensor& ids);
  // weight: rows [first_id(), first_id() + num_embeddings / t).
  std::vector<ParameterPlacement> parameter_placements() const override;

  int64_t num_embeddings() const { return num_; }  // the whole vocabulary
  int64_t first_id() const { return first_; }      // of this rank's rows

  at::Tensor weight;  // [num_embeddings / t, embedding_dim]

 private:
  void take_shard(const torch::nn::Embedding& full);
  ParallelLinearOptions options_;
  int64_t num_, first_ = 0;
};
TORCH_MODULE(VocabParallelEmbedding);

// PyTorch's loss_parallel: F.cross_entropy of logits split along the
// vocabulary (the last dimension: this rank's [N, V/t] slice, as a
// ColumnParallelLinear gives it by default) against targets
// [N] of ids in [0, V), without gathering the logits: the ranks exchange
// each row's maximum, its sum of exponentials and its target's logit (three
// all_reduces of N values; a fourth, the row's sum of logits, with label
// smoothing). The loss is the same on every rank, and its gradient reaches
// each rank's logits as that slice of the whole softmax's.
// `options` are F.cross_entropy's: rows whose target is ignore_index (-100)
// take no part (no loss, no gradient, not counted by the mean: padding);
// reduction mean, sum or none (a loss per row, 0 where ignored);
// label_smoothing. Class weights are refused (InvalidArgument).
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits_shard, const at::Tensor& target,
                                        const std::shared_ptr<ProcessGroup>& group = nullptr,
                                        const torch::nn::CrossEntropyLossOptions& options = {});

// ---- the plan form (PyTorch's parallelize_module) ---------------------------

// PyTorch's styles: a torch::nn::Linear becomes a ColumnParallelLinear
// (ColwiseParallel) or a RowParallelLinear (RowwiseParallel), a
// torch::nn::Embedding a VocabParallelEmbedding (RowwiseParallel), with
// these layouts (unset: the layer's defaults, as ParallelLinearOptions
// lists them).
struct ColwiseParallel {
  DTRAIN_ARG(std::optional<Layout>, input_layouts) = std::nullopt;
  DTRAIN_ARG(std::optional<Layout>, output_layouts) = std::nullopt;
};
struct RowwiseParallel {
  DTRAIN_ARG(std::optional<Layout>, input_layouts) = std::nullopt;
  DTRAIN_ARG(std::optional<Layout>, output_layouts) = std::nullopt;
};
// Any module that runs on sequence shards (a norm): its parameters are
// marked (mark_sequence_parallel); the module itself stays.
struct SequenceParallel {};
using ParallelStyle = std::variant<ColwiseParallel, RowwiseParallel, SequenceParallel>;
// By child name ("2": a Sequential's third child, unless named otherwise).
using ParallelizePlan = std::map<std::string, ParallelStyle>;

// A Sequential like `module`, whose children that `plan` names are
// replaced by their tensor-parallel forms over `group`, built from them
// (this rank's shard copied in), and whose other children are `module`'s
// own (shared). Names stay, so state dicts and checkpoints of the result
// and of `module` name the same tensors. libtorch has no forward hooks, a
// module's members cannot be swapped from outside, and a Sequential cannot
// hold a Sequential, so the plan form rebuilds one Sequential's own
// children: for a model of your own, build its layers as
// ColumnParallelLinear and the rest directly. A plan entry that names no
// child, or a style that a child's type does not take, is an
// InvalidArgument.
torch::nn::Sequential parallelize_module(const torch::nn::Sequential& module,
                                         const std::shared_ptr<ProcessGroup>& group,
                                         const ParallelizePlan& plan);

}  // namespace dtrain::tensor_parallel
