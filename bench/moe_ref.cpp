// dtrain-bench rank moe-ref: dtrain's MoE layer (expert_parallel.h) at EP =
// the world's size, on the initial values and data of
// bench/scripts/moe_vs_pytorch.py, which trains the same block in plain
// PyTorch in one process on the whole batch (run both with
// bench/scripts/moe_vs_pytorch.sh).
//
// The block: y = x + MoE(x), 8 experts, top 2, sigmoid scores normalised,
// a shared expert, the auxiliary-loss-free bias (updated after each step);
// loss: mean squared error to a target. Each rank takes its share of the
// 8 sequences; the dense parameters are under DDP (the experts left out).
// 5 AdamW steps, lr 1e-3. Each rank writes, under --out/rank<r>/, float32
// values: output (the first step's, its sequences), loss (every step's
// mean over the ranks), counts (the first step's tokens per expert from
// its sequences), grad.<name> (its part of each gradient, first step),
// param.<name> (its part after the last step), bias.

#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <sys/stat.h>

#include "dtrain/dtrain.h"
#include "ranks.h"

namespace dtrain::bench {
namespace moe_ref {  // (named: dtrain-bench is a unity build)

namespace ep = expert_parallel;
constexpr int kSteps = 5;
constexpr int64_t kSequences = 8, kSeq = 4, kDim = 16, kHidden = 32, kExperts = 8;

// The k-th parameter's whole value (by name, sorted), the formula that
// moe_vs_pytorch.py repeats: about 1/sqrt(fan-in).
at::Tensor formula(int64_t k, at::IntArrayRef shape) {
  const int64_t n = c10::multiply_integers(shape);
  const auto wave = (torch::arange(n, torch::kFloat) * (0.37 + 0.013 * static_cast<double>(k)) +
                     static_cast<double>(k)).sin().reshape(shape);
  return wave / std::sqrt(static_cast<double>(shape.back()));
}

at::Tensor input(int step) {
  return (torch::arange(kSequences * kSeq * kDim, torch::kFloat) * 0.05 + step).sin().reshape({kSequences, kSeq, kDim});
}

at::Tensor target(int step) {
  return (torch::arange(kSequences * kSeq * kDim, torch::kFloat) * 0.07 + 2 * step).cos().reshape(
             {kSequences, kSeq, kDim}) * 0.5;
}

void write(const std::string& path, const at::Tensor& t) { write_float32(path, t); }

// The whole shapes of the layer's parameters, by name.
std::map<std::string, std::vector<int64_t>> whole_shapes() {
  return {{"router.gate.weight", {kExperts, kDim}},
          {"experts.w1", {kExperts, kHidden, kDim}},
          {"experts.w2", {kExperts, kDim, kHidden}},
          {"experts.w3", {kExperts, kHidden, kDim}},
          {"shared_expert.w1.weight", {kHidden, kDim}},
          {"shared_expert.w2.weight", {kDim, kHidden}},
          {"shared_expert.w3.weight", {kHidden, kDim}}};
}

int run(const Args& a) {
  init_process_group(InitOptions().backend(a.get("backend", "tcp")));
  torch::set_num_threads(1);
  auto g = default_group();
  const int rank = g->rank(), world = g->size();
  const std::string out = a.get("out", "moe-ref"), dir = out + "/rank" + std::to_string(rank);
  for (const std::string& d : {out, dir}) mkdir(d.c_str(), 0755);
  ep::MoE moe(ep::MoEOptions(kDim, kHidden, kExperts)
                  .top_k(2)
                  .shared_expert_hidden_dim(kHidden)
                  .score_func(ep::ScoreFunction::kSigmoid)
                  .route_norm(true)
                  .load_balance_coeff(1e-3)
                  .ep_group(g));
  {
    torch::NoGradGuard no_grad;
    int64_t k = 0;
    const auto params = moe->named_parameters();
    for (const auto& [name, shape] : whole_shapes()) {  // (a std::map: sorted by name)
      auto whole = formula(k++, shape);
      if (name.rfind("experts.", 0) == 0)
        whole = whole.narrow(0, moe->experts->first_expert(), moe->experts->local_experts());
      params[name].copy_(whole);
    }
  }
  DistributedDataParallel ddp(moe.ptr(), DDPOptions().process_group(g).params_and_buffers_to_ignore(
                                             ep::ignored_by_data_parallel(*moe)));
  torch::optim::AdamW opt(moe->parameters(), torch::optim::AdamWOptions(1e-3));
  const int64_t mine = kSequences / world;
  std::vector<at::Tensor> losses;
  for (int step = 0; step < kSteps; ++step) {
    const auto x = input(step).narrow(0, rank * mine, mine), y = target(step).narrow(0, rank * mine, mine);
    opt.zero_grad();
    const auto output = ddp.forward(x) + x;
    const auto loss = torch::mse_loss(output, y);
    loss.backward();
    auto mean = loss.detach().reshape({1}).clone();
    g->all_reduce(mean)->wait();
    losses.push_back(mean / world);
    if (step == 0) {
      write(dir + "/output", output);
      write(dir + "/counts", moe->tokens_per_expert);  // this rank's tokens per expert (before the first update)
      for (const auto& p : moe->named_parameters()) write(dir + "/grad." + p.key(), p.value().grad());
    }
    opt.step();
    moe->update_expert_bias(g);
  }
  write(dir + "/loss", torch::cat(losses));
  for (const auto& p : moe->named_parameters()) write(dir + "/param." + p.key(), p.value());
  write(dir + "/bias", moe->expert_bias);
  destroy_process_group();
  return 0;
}

}  // namespace moe_ref

int moe_reference_rank_main(const Args& a) { return moe_ref::run(a); }

}  // namespace dtrain::bench
