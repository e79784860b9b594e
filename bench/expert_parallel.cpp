// dtrain-bench ep: what expert parallelism saves per rank and what it
// gains in speed, each beside its baseline run in the same invocation.
//
//   memory  per-rank bytes of the experts' parameters, gradients and Adam's
//           two moments after one step of an MoE layer (--experts SwiGLU
//           experts of --dim x --hidden, top --top-k, a shared expert) at
//           EP 2 and 4 (ranks are processes), as a ratio to the same layer
//           unsharded in one process; and of the whole layer.
//   speed   the layer y = x + MoE(x) trained with Adam (the dense
//           parameters under DDP, the experts left out) at EP 2 over auto,
//           a process per rank on one intra-op thread, each rank --tokens
//           tokens a step, against one process on 2 intra-op threads
//           training on both ranks' tokens: tokens/s (medians over --steps
//           steps after one, alternating runs); the routing's balance (the
//           tokens of the most loaded expert over the mean), and the rows
//           each all-to-all moves per rank and step.
//
//   dtrain-bench ep [--experts 8] [--dim 256] [--hidden 512] [--top-k 2]
//                   [--tokens 2048] [--steps 5] [--runs 3] [--run memory,speed]

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "dtrain/dtrain.h"
#include "ranks.h"

namespace dtrain::bench {
namespace ep_bench {  // (named: dtrain-bench is a unity build)

namespace ep = expert_parallel;

ep::MoE layer(const Args& a, const std::shared_ptr<ProcessGroup>& group) {
  torch::manual_seed(3);  // every rank draws the whole layer alike
  return ep::MoE(ep::MoEOptions(a.num("dim", 256), a.num("hidden", 512), a.num("experts", 8))
                     .top_k(a.num("top-k", 2))
                     .score_func(ep::ScoreFunction::kSigmoid)
                     .route_norm(true)
                     .load_balance_coeff(1e-3)
                     .shared_expert_hidden_dim(a.num("hidden", 512))
                     .ep_group(group));
}

// Adam's two moments of every parameter it holds.
int64_t moment_bytes(const torch::optim::Adam& adam) {
  int64_t bytes = 0;
  for (const auto& item : adam.state()) {
    auto& s = static_cast<torch::optim::AdamParamState&>(*item.second);
    bytes += s.exp_avg().nbytes() + s.exp_avg_sq().nbytes();
  }
  return bytes;
}

// ep-memory: one Adam step, then the bytes kept for the experts and for
// the whole layer on this rank (world 1: unsharded).
int memory_rank(const Args& a) {
  init_process_group(InitOptions().backend("tcp"));
  auto group = get_world_size() > 1 ? default_group() : nullptr;
  auto moe = layer(a, group);
  // The experts' Adam and the rest's (Adam steps each parameter alone).
  std::vector<at::Tensor> dense;
  for (const auto& p : moe->named_parameters())
    if (p.key().rfind("experts.", 0) != 0) dense.push_back(p.value());
  torch::optim::Adam adam_experts(moe->experts->parameters(), torch::optim::AdamOptions(1e-3));
  torch::optim::Adam adam_dense(dense, torch::optim::AdamOptions(1e-3));
  torch::manual_seed(10 + get_rank());
  const auto x = torch::randn({64, a.num("dim", 256)});
  (moe(x) + x).pow(2).mean().backward();
  adam_experts.step();
  adam_dense.step();
  int64_t experts = moment_bytes(adam_experts), all = experts + moment_bytes(adam_dense);
  for (const auto& p : moe->experts->parameters()) experts += 2 * p.nbytes();
  for (const auto& p : moe->parameters()) all += 2 * p.nbytes();
  std::printf("result experts=%lld all=%lld\n", static_cast<long long>(experts), static_cast<long long>(all));
  destroy_process_group();
  return 0;
}

// ep-speed: --tokens tokens per rank a step (world 1: --tokens x --ranks),
// EP over the world's ranks on `auto`.
int speed_rank(const Args& a) {
  init_process_group(InitOptions().backend("auto"));
  torch::set_num_threads(a.num("threads", 1));
  const int world = get_world_size();
  auto moe = layer(a, world > 1 ? default_group() : nullptr);
  DistributedDataParallel ddp(moe.ptr(), DDPOptions().params_and_buffers_to_ignore(ep::ignored_by_data_parallel(*moe)));
  torch::optim::Adam adam(moe->parameters(), torch::optim::AdamOptions(1e-3));
  const int64_t tokens = a.num("tokens", 2048) * (world > 1 ? 1 : a.num("ranks", 2));
  torch::manual_seed(20 + get_rank());
  const auto x = torch::randn({tokens, a.num("dim", 256)});
  double most = 0;
  auto step = [&] {
    adam.zero_grad();
    (ddp.forward(x) + x).pow(2).mean().backward();
    adam.step();
    auto counts = moe->tokens_per_expert.clone();
    if (world > 1) default_group()->all_reduce(counts)->wait();
    most = (counts.max() / counts.mean()).item<double>();
    moe->update_expert_bias(world > 1 ? default_group() : nullptr);
  };
  step();
  std::vector<double> seconds;
  for (int i = 0; i < a.num("steps", 5); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("result tokens_per_s=%.1f busiest=%.3f\n", static_cast<double>(tokens * world) / median(seconds), most);
  destroy_process_group();
  return 0;
}

void report_memory(const Args& a) {
  const auto whole = run_ranks(1, "ep-memory", a);
  const double experts = field(whole, "experts"), all = field(whole, "all");
  std::printf("memory: an MoE layer of %d experts (%d x %d SwiGLU), top %d, a shared expert; parameters + "
              "gradients + Adam per rank after a step, against one process unsharded (experts %.1f MiB, the "
              "layer %.1f MiB)\n",
              a.num("experts", 8), a.num("dim", 256), a.num("hidden", 512), a.num("top-k", 2), experts / (1 << 20),
              all / (1 << 20));
  for (int p : {2, 4}) {
    const auto mine = run_ranks(p, "ep-memory", a);
    std::printf("  EP %d: experts %7.2f MiB per rank, %.3fx; the layer %7.2f MiB, %.3fx\n", p,
                field(mine, "experts") / (1 << 20), field(mine, "experts") / experts, field(mine, "all") / (1 << 20),
                field(mine, "all") / all);
  }
}

void report_speed(const Args& a) {
  std::vector<double> one, two, busiest;
  for (int run = 0; run < a.num("runs", 3); ++run) {  // alternating, so that drift hits both
    Args args = a;
    args.flags["threads"] = "2";
    one.push_back(field(run_ranks(1, "ep-speed", args), "tokens_per_s"));
    args.flags["threads"] = "1";
    const auto out = run_ranks(2, "ep-speed", args);
    two.push_back(field(out, "tokens_per_s"));
    busiest.push_back(field(out, "busiest"));
  }
  const double rows = static_cast<double>(a.num("tokens", 2048)) * a.num("top-k", 2);
  std::printf("speed: y = x + MoE(x), Adam, %d tokens a step per rank (2 ranks), medians of %d runs; the busiest "
              "expert got %.2fx the mean\n", a.num("tokens", 2048), a.num("runs", 3), median(busiest));
  std::printf("  one process, 2 intra-op threads: %8.0f tokens/s\n", median(one));
  std::printf("  EP 2 (auto), 1 thread per rank:  %8.0f tokens/s, %.3fx\n", median(two), median(two) / median(one));
  std::printf("  moved per rank and step: 4 all-to-alls (2 forward, 2 backward) of %.0f rows x %d floats "
              "(%.2f MiB each), about half of them to the other rank\n",
              rows, a.num("dim", 256), rows * a.num("dim", 256) * 4 / (1 << 20));
}

}  // namespace ep_bench

bool is_ep_mode(const std::string& mode) { return mode == "ep-memory" || mode == "ep-speed"; }

int ep_rank_main(const std::string& mode, const Args& a) {
  return mode == "ep-memory" ? ep_bench::memory_rank(a) : ep_bench::speed_rank(a);
}

int bench_ep(const Args& a) {
  const std::string run = a.get("run", "memory,speed");
  if (run.find("memory") != std::string::npos) ep_bench::report_memory(a);
  if (run.find("speed") != std::string::npos) ep_bench::report_speed(a);
  return 0;
}

}  // namespace dtrain::bench
