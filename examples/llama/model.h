#pragma once

// A small Llama-style decoder (RMSNorm, rotary position embeddings, causal
// multi-head attention, a SwiGLU feed-forward or a mixture of SwiGLU
// experts) written with dtrain's tensor-parallel and expert-parallel
// modules, so that one definition runs in one process, at any
// tensor-parallel and expert-parallel size, with or without sequence
// parallelism and activation checkpointing, and cut into pipeline stages.
//
// Parameters are named as torchtitan's Llama names them
// (tok_embeddings.weight, layers.3.attention.wq.weight,
// layers.3.feed_forward.w2.weight, layers.3.moe.experts.w1,
// layers.3.moe.router.gate.weight, norm.weight, output.weight), by the
// global layer index whatever stage holds the layer, so checkpoints and
// the comparison with PyTorch (bench/scripts/tp_vs_pytorch.py) line up.

#include <dtrain/dtrain.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>

namespace llama {

struct Config {
  int64_t vocab = 256;  // byte-level tokens
  int64_t dim = 128;
  int64_t layers = 4;
  int64_t heads = 8;
  int64_t hidden = 352;  // the SwiGLU's inner width
  int64_t seq = 64;      // the longest sequence (rotary tables)
  double norm_eps = 1e-5;
  double rope_theta = 10000;
  double dropout = 0;  // on attention probabilities and on each residual branch
  // > 0: each layer's feed-forward is a mixture of this many SwiGLU experts
  // of `hidden` width (sigmoid routing to top_k of them, auxiliary-loss-free
  // balancing), with a shared expert of the same width when shared_expert.
  int64_t experts = 0;
  int64_t top_k = 2;
  bool shared_expert = false;
  // The expert bias's step (load_balance_coeff); 0: no balancing. 1e-2: the
  // router here learns at AdamW's 2e-3, and at 1e-3 the bias lost to it (8
  // experts, 150 steps: the busiest 2.35x the mean, one idle; at 1e-2,
  // 0.80x to 1.21x, the same loss).
  double balance_rate = 1e-2;
};

// How this rank's part of the model is split.
struct Layout {
  std::shared_ptr<dtrain::ProcessGroup> tp;  // the tensor-parallel group (may have one rank)
  bool sequence_parallel = false;           // between the tensor-parallel layers (Megatron's SP)
  bool checkpoint = false;                  // each layer an activation-checkpointed segment
  std::shared_ptr<dtrain::ProcessGroup> ep;  // the experts' group (null: every expert here)
  // The context-parallel group: each rank holds a head-tail part of every
  // sequence, and attention runs over the group, by ring attention or
  // (ulysses) by Ulysses' all-to-alls; a group of one rank runs ring
  // attention's blockwise softmax alone. Null: plain attention, the
  // scores of the whole sequence kept for the backward.
  std::shared_ptr<dtrain::ProcessGroup> cp;
  bool ulysses = false;
  // With checkpoint: selective, each layer keeping its tensor-parallel
  // layers' outputs (dtrain::keep_matmul_outputs); the rest is recomputed.
  bool keep_matmul_outputs = false;

  // How the activations between the tensor-parallel layers lie over tp:
  // split on the sequence under SP, whole otherwise.
  dtrain::tensor_parallel::Layout activations() const {
    return sequence_parallel ? dtrain::tensor_parallel::Shard(1) : dtrain::tensor_parallel::Replicate();
  }

  // Tensor parallelism over `tp` alone (a group of one rank: the whole model).
  static Layout over(std::shared_ptr<dtrain::ProcessGroup> tp) {
    Layout l;
    l.tp = std::move(tp);
    return l;
  }
};

// The whole parameters' initial values, by name, for layers
// [first_layer, last_layer) and the embedding and head when asked: each
// layer's from a generator seeded by `seed` and its index, so a stage
// draws the values the whole model would, whatever the layout.
using Values = std::map<std::string, at::Tensor>;
Values initial_values(const Config& c, uint64_t seed, int64_t first_layer, int64_t last_layer,
                      bool embedding, bool head);

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(const at::Tensor& weight, double eps);
  at::Tensor forward(const at::Tensor& x) { return normalize(x, weight); }
  // With `w` in place of weight (weight as sum_gradients_together hands it on).
  at::Tensor normalize(const at::Tensor& x, const at::Tensor& w) const;
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

class AttentionImpl : public torch::nn::Module {
 public:
  AttentionImpl(const Config& c, const Layout& l, const Values& v, const std::string& prefix);
  // x: [batch, sequence (this rank's part under CP, its shard of that
  // under SP), dim]
  at::Tensor forward(const at::Tensor& x);

 private:
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
  Config c_;
  Layout l_;
  std::shared_ptr<dtrain::ProcessGroup> cp_;  // null: plain attention over the whole sequence here
  bool ulysses_ = false;
  int64_t local_heads_;
  dtrain::tensor_parallel::ColumnParallelLinear wq_{nullptr}, wk_{nullptr}, wv_{nullptr};
  dtrain::tensor_parallel::RowParallelLinear wo_{nullptr};
  at::Tensor cos_, sin_;  // [seq, head_dim / 2]
};
TORCH_MODULE(Attention);

class FeedForwardImpl : public torch::nn::Module {
 public:
  FeedForwardImpl(const Config& c, const Layout& l, const Values& v, const std::string& prefix);
  at::Tensor forward(const at::Tensor& x);

 private:
  Layout l_;
  dtrain::tensor_parallel::ColumnParallelLinear w1_{nullptr}, w3_{nullptr};
  dtrain::tensor_parallel::RowParallelLinear w2_{nullptr};
};
TORCH_MODULE(FeedForward);

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const Config& c, const Layout& l, const Values& v, int64_t index);
  at::Tensor forward(const at::Tensor& x);

 private:
  at::Tensor residual_dropout(const at::Tensor& x);
  Config c_;
  Layout l_;
  RMSNorm attention_norm_{nullptr}, ffn_norm_{nullptr};
  Attention attention_{nullptr};
  FeedForward feed_forward_{nullptr};

 public:
  dtrain::expert_parallel::MoE moe{nullptr};  // in place of feed_forward_ with experts
};
TORCH_MODULE(Block);

// Layers [first_layer, last_layer), with the token embedding in front when
// `embedding` and the final norm and output projection behind when `head`:
// the whole model, or one pipeline stage of it. Its input is token ids
// [batch, sequence] when it embeds, else activations [batch, sequence
// (this rank's shard under SP), dim]; its output activations, or with the
// head this rank's vocabulary shard of the logits [batch, sequence,
// vocab / tp] (loss: dtrain::tensor_parallel::vocab_parallel_cross_entropy).
class StageImpl : public torch::nn::Module {
 public:
  StageImpl(const Config& c, const Layout& l, const Values& initial, int64_t first_layer,
            int64_t last_layer, bool embedding, bool head);
  at::Tensor forward(at::Tensor x);
  // This stage's mixture-of-experts layers (none without experts).
  std::vector<dtrain::expert_parallel::MoE> moes() const;

 private:
  Layout l_;
  dtrain::tensor_parallel::VocabParallelEmbedding tok_embeddings_{nullptr};
  std::vector<Block> layers_;
  RMSNorm norm_{nullptr};
  dtrain::tensor_parallel::ColumnParallelLinear output_{nullptr};
};
TORCH_MODULE(Stage);

// The mean cross-entropy of a head's logits shard against targets [batch, sequence].
at::Tensor loss(const at::Tensor& logits_shard, const at::Tensor& targets,
                const std::shared_ptr<dtrain::ProcessGroup>& tp);

}  // namespace llama
