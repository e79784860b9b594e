#pragma once

// A pre-norm MLP block, x + down(gelu(up(norm(x)))), in one process and
// tensor-parallel (a ColumnParallelLinear up, a RowParallelLinear down, the
// LayerNorm marked for sequence parallelism when the layers use it), built
// from the same initial values; and the one-process run the parallel runs
// are held against (tensor_parallel_test's binary).

#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/activation_checkpoint.h"
#include "dtrain/tensor_parallel.h"
#include "harness/shards.h"
#include "harness/training.h"

namespace dtrain::testing {

struct BlockInit {
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
};

inline BlockInit initial_block(int64_t hidden, int64_t inner, uint64_t seed = 11) {
  torch::manual_seed(seed);
  BlockInit b{torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})),
              torch::nn::Linear(hidden, inner), torch::nn::Linear(inner, hidden)};
  torch::NoGradGuard no_grad;
  b.norm->weight.normal_(1.0, 0.3);  // not the identity: its gradient matters
  b.norm->bias.normal_(0.0, 0.3);
  return b;
}

inline torch::nn::LayerNorm copy_of_norm(const torch::nn::LayerNorm& n) {
  return std::dynamic_pointer_cast<torch::nn::LayerNormImpl>(n->clone());
}

// Each parameter's name, and the dimension its tensor-parallel form splits
// (-1: whole on every rank).
inline const std::vector<std::pair<std::string, int64_t>>& block_params() {
  static const std::vector<std::pair<std::string, int64_t>> params = {
      {"norm.weight", -1}, {"norm.bias", -1}, {"up.weight", 0},
      {"up.bias", 0},      {"down.weight", 1}, {"down.bias", -1}};
  return params;
}

struct PlainBlockImpl : torch::nn::Module {
  explicit PlainBlockImpl(const BlockInit& b)
      : norm(register_module("norm", copy_of_norm(b.norm))),
        up(register_module("up", copy_of(b.up))),
        down(register_module("down", copy_of(b.down))) {}
  at::Tensor forward(const at::Tensor& x) { return x + down(torch::gelu(up(norm(x)))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
TORCH_MODULE(PlainBlock);

// The up layer's options over `group`: with sequence parallelism its input
// is split along `sequence_dim` (and the down layer's output so).
inline tensor_parallel::ParallelLinearOptions block_options(std::shared_ptr<ProcessGroup> group,
                                                            bool sequence_parallel, int64_t sequence_dim = 1) {
  return tensor_parallel::ParallelLinearOptions().group(std::move(group)).input_layout(
      sequence_parallel ? tensor_parallel::Shard(sequence_dim) : tensor_parallel::Replicate());
}

// With checkpoint, the block runs as one activation-checkpointed segment
// (selective with a policy in `checkpoint_options`).
// `options` are the up layer's; the down layer gives back the layout the
// up layer takes.
struct TpBlockImpl : torch::nn::Module {
  TpBlockImpl(const BlockInit& b, const tensor_parallel::ParallelLinearOptions& options,
              bool checkpoint = false, ActivationCheckpointOptions checkpoint_options = {})
      : norm(register_module("norm", copy_of_norm(b.norm))),
        up(register_module("up", tensor_parallel::ColumnParallelLinear(b.up, options))),
        down(register_module("down", tensor_parallel::RowParallelLinear(
                                         b.down, tensor_parallel::ParallelLinearOptions(options)
                                                     .input_layout(std::nullopt)
                                                     .output_layout(up->options().input_layout())))),
        checkpoint_(checkpoint),
        checkpoint_options_(std::move(checkpoint_options)) {
    if (*up->options().input_layout() != tensor_parallel::Replicate())
      tensor_parallel::mark_sequence_parallel(*norm, options.group());
  }
  at::Tensor forward(const at::Tensor& x) {
    auto run = [this](at::Tensor h) { return h + down(torch::gelu(up(norm(h)))); };
    return checkpoint_ ? activation_checkpoint(run, x, checkpoint_options_) : run(x);
  }
  torch::nn::LayerNorm norm;
  tensor_parallel::ColumnParallelLinear up;
  tensor_parallel::RowParallelLinear down;

 private:
  bool checkpoint_;
  ActivationCheckpointOptions checkpoint_options_;
};
TORCH_MODULE(TpBlock);

struct BlockReference {
  at::Tensor output, input_grad;  // of the first step
  std::map<std::string, at::Tensor> grads, after;  // the first step's; after the last
};

// The optimizer `make` builds on the mean squared error, one step per (x, y).
inline BlockReference one_process(const BlockInit& b, const std::vector<at::Tensor>& xs,
                                  const std::vector<at::Tensor>& ys, const MakeOptimizer& make) {
  PlainBlock block(b);
  auto optimizer = make(block->parameters());
  BlockReference ref;
  for (size_t step = 0; step < xs.size(); ++step) {
    optimizer->zero_grad();
    auto x = xs[step].clone().requires_grad_(true);
    auto out = block(x);
    torch::mse_loss(out, ys[step]).backward();
    if (step == 0) {
      ref.output = out.detach().clone();
      ref.input_grad = x.grad().clone();
      for (const auto& item : block->named_parameters()) ref.grads[item.key()] = item.value().grad().clone();
    }
    optimizer->step();
  }
  for (const auto& item : block->named_parameters()) ref.after[item.key()] = item.value().detach().clone();
  return ref;
}

// Rank `tp` of `ranks`' part of a whole block parameter `name`.
inline at::Tensor block_shard(const std::map<std::string, at::Tensor>& whole, const std::string& name,
                              int tp, int ranks) {
  for (const auto& [n, split] : block_params())
    if (n == name) return split < 0 ? whole.at(name) : shard(whole.at(name), split, tp, ranks);
  ADD_FAILURE() << "no block parameter " << name;
  return {};
}

}  // namespace dtrain::testing
