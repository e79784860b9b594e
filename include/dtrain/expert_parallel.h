#pragma once

// Mixture-of-experts layers and expert parallelism (torchtitan's MoE,
// TokenChoiceTopKRouter and GroupedExperts; Megatron-Core's EP): a token
// goes to top_k of num_experts SwiGLU experts chosen by a router, and with
// an expert-parallel group each rank holds num_experts / ep_size of them
// and the tokens travel to their experts and back by all-to-all.
//
//   namespace ep = dtrain::expert_parallel;
//   ep::MoE moe(ep::MoEOptions(512, 1024, 8).top_k(2).shared_expert_hidden_dim(1024)
//                   .score_func(ep::ScoreFunction::kSigmoid).load_balance_coeff(1e-3)
//                   .ep_group(mesh.get_group("ep")));
//   auto y = moe(x);                                  // x, y: [..., 512]
//   ...backward, optimizer step...
//   moe->update_expert_bias(dp_group);                // the auxiliary-loss-free balancing
//
// Contract:
//  - Routing: the router's scores are softmax or sigmoid of a bias-free
//    linear gate; each token takes the top_k experts of scores +
//    expert_bias (the bias chooses, it never weighs, and takes no
//    gradient); its weights are those experts' scores, divided by their sum
//    with route_norm, times route_scale; the experts' outputs are summed
//    with those weights, plus the shared expert's output where there is one.
//  - Dropless: every token reaches each of its experts, however many pick
//    the same one; an expert with no tokens anywhere gets a zero gradient
//    (never NaN, never undefined).
//  - With ep_group (of size P; num_experts divisible by P), rank r holds
//    experts [r E/P, (r+1) E/P). Every rank of the group runs the same
//    forwards and backwards (the dispatch is a collective): per MoE
//    forward, one all-to-all of the token counts and one of the routed
//    rows there and one back; per backward, two of the rows' gradients.
//    Each is labelled with the layer's name in the flight recorder.
//  - The ranks of ep_group are data-parallel ranks (each its own tokens,
//    its loss a mean over them, as under DDP or FSDP). An expert's gradient
//    then gathers every rank's tokens through the all-to-all; it is divided
//    by P as it arrives, so that it is the gradient of the ranks' mean loss,
//    as one process computes it on the whole batch. The other parameters
//    (the router's gate, the shared expert, everything outside the MoE) are
//    the same on every rank: average their gradients over the
//    data-parallel ranks as usual (DDP with
//    DDPOptions::params_and_buffers_to_ignore(ignored_by_data_parallel(model)):
//    the experts must not be averaged, nor the token counts replaced by rank
//    0's). With more data-parallel ranks than P,
//    each expert lives on several ranks: average its gradient over those.
//  - Built from sizes, the experts are rank r's slice of the experts that
//    the same sizes and the same seed would make in one process (every rank
//    must seed alike). GroupedExperts names them w1 [E, hidden, dim]
//    (gate_proj), w2 [E, dim, hidden] (down_proj) and w3 [E, hidden, dim]
//    (up_proj), and lists their placements (parameter_placement.h): a
//    checkpoint holds whole [E, ...] tensors and loads at another EP size
//    or in one process.
//  - Bad input (experts not divisible by P, top_k out of 1..num_experts,
//    ranks of the EP group holding different layers, compared on every
//    rank at the first forward; a peer announcing counts that do not add
//    up) is an InvalidArgument naming the module and the numbers. See
//    docs/expert-parallel.md.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/arg.h"
#include "dtrain/parameter_placement.h"
#include "dtrain/process_group.h"

namespace dtrain::expert_parallel {

enum class ScoreFunction { kSoftmax, kSigmoid };

struct MoEOptions {
  MoEOptions(int64_t dim, int64_t hidden_dim, int64_t num_experts)
      : dim_(dim), hidden_dim_(hidden_dim), num_experts_(num_experts) {}
  DTRAIN_ARG(int64_t, dim);
  DTRAIN_ARG(int64_t, hidden_dim);  // each expert's
  DTRAIN_ARG(int64_t, num_experts);
  DTRAIN_ARG(int64_t, top_k) = 1;
  DTRAIN_ARG(ScoreFunction, score_func) = ScoreFunction::kSoftmax;
  // Divide a token's top_k scores by their sum.
  DTRAIN_ARG(bool, route_norm) = false;
  DTRAIN_ARG(double, route_scale) = 1.0;
  // A shared expert every token goes through (a SwiGLU of this hidden
  // size); 0: none.
  DTRAIN_ARG(int64_t, shared_expert_hidden_dim) = 0;
  // > 0: auxiliary-loss-free load balancing (arXiv 2408.15664): an
  // expert_bias steered by update_expert_bias() at this rate. 0: no bias.
  DTRAIN_ARG(double, load_balance_coeff) = 0.0;
  // The expert-parallel group; null: every expert on this rank.
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, ep_group) = nullptr;
  // What the flight recorder and the timeline call this layer's
  // all-to-alls ("<name>: dispatch", "<name>: combine, backward", ...):
  // the layer's place in the model, say "layers.3.moe".
  DTRAIN_ARG(std::string, name) = "moe";
};

// What the router decided for T tokens.
struct Routing {
  at::Tensor scores;              // [T, top_k] float: the weights of the chosen experts
  at::Tensor experts;             // [T, top_k] long: the chosen experts
  at::Tensor tokens_per_expert;   // [num_experts] long
};

class TokenChoiceTopKRouterImpl : public torch::nn::Module {
 public:
  explicit TokenChoiceTopKRouterImpl(const MoEOptions& options);
  // x: [T, dim]; expert_bias: [num_experts] or undefined.
  Routing forward(const at::Tensor& x, const at::Tensor& expert_bias = {});
  torch::nn::Linear gate{nullptr};  // [num_experts, dim], no bias

 private:
  MoEOptions options_;
};
TORCH_MODULE(TokenChoiceTopKRouter);

// This rank's experts, SwiGLU each: w2 (silu(x w1^T) * (x w3^T))^T.
class GroupedExpertsImpl : public torch::nn::Module, public ShardedParameters {
 public:
  explicit GroupedExpertsImpl(const MoEOptions& options);
  // x: this rank's experts' rows, expert by expert (counts[j] rows for its
  // j-th); the outputs in the same order.
  at::Tensor forward(const at::Tensor& x, const std::vector<int64_t>& counts);
  std::vector<ParameterPlacement> parameter_placements() const override;
  int64_t first_expert() const { return first_; }
  int64_t local_experts() const { return local_; }

  at::Tensor w1, w2, w3;  // [E/P, hidden, dim], [E/P, dim, hidden], [E/P, hidden, dim]

 private:
  MoEOptions options_;
  int64_t first_ = 0, local_ = 0;
};
TORCH_MODULE(GroupedExperts);

// The shared expert: a dense SwiGLU (w1, w3: dim -> hidden; w2: hidden -> dim).
class FeedForwardImpl : public torch::nn::Module {
 public:
  FeedForwardImpl(int64_t dim, int64_t hidden_dim);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
};
TORCH_MODULE(FeedForward);

class MoEImpl : public torch::nn::Module {
 public:
  explicit MoEImpl(const MoEOptions& options);
  // x: [..., dim]; the same shape back.
  at::Tensor forward(const at::Tensor& x);
  // The auxiliary-loss-free balancing step (after the optimizer's): the
  // tokens each expert got since the last call, summed over `group` (the
  // ranks whose tokens differ: the data-parallel ones; null: this rank's
  // only), move expert_bias by load_balance_coeff towards the experts that
  // got fewer than the mean (its mean kept at 0); the counts restart. Every
  // rank of `group` calls. Nothing without load_balance_coeff.
  void update_expert_bias(const std::shared_ptr<ProcessGroup>& group = nullptr);
  const MoEOptions& options() const { return options_; }

  TokenChoiceTopKRouter router{nullptr};
  GroupedExperts experts{nullptr};
  FeedForward shared_expert{nullptr};  // or null
  at::Tensor expert_bias;              // buffer [num_experts], or undefined
  at::Tensor tokens_per_expert;        // buffer [num_experts] float, or undefined

 private:
  MoEOptions options_;
  bool compared_across_ranks_ = false;  // the EP group's layers, at the first forward
};
TORCH_MODULE(MoE);

// The fully qualified names of what in `model` is each rank's own: the
// parameters of every GroupedExperts and the tokens_per_expert buffer of
// every MoE. For DDPOptions::params_and_buffers_to_ignore.
std::vector<std::string> ignored_by_data_parallel(const torch::nn::Module& model);

// The dispatch as a function, for experts of one's own: routes `x`'s rows
// ([T, dim]) to their experts over `group` (null: none), runs `experts` on
// this rank's share, and brings the outputs back, weighted and summed per
// token. An autograd operation; its all-to-alls carry `name` into the
// flight recorder (MoEOptions::name).
at::Tensor dispatch_and_combine(const at::Tensor& x, const Routing& routing, GroupedExpertsImpl& experts,
                                const std::shared_ptr<ProcessGroup>& group, const std::string& name = "moe");

}  // namespace dtrain::expert_parallel
