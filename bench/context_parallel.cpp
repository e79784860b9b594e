// dtrain-bench cp: what context parallelism (context_parallel.h) does for
// a rank's work and memory.
//
// balance: how evenly ring attention spreads causal attention's work over
// the ranks of a CP group, with head-tail sharding against contiguous, at
// CP 2 and 4. Each rank (a process, one intra-op thread) runs --steps
// forward and backward passes of causal ring attention over its part of a
// sequence of --seq tokens (--heads q heads, --kv-heads kv heads, head dim
// --dim, batch 1) after one warm-up pass, and reports the CPU time of its
// own thread (the blocks' compute; the transport's I/O threads and waiting
// are not in it). Printed per CP size and sharding: every rank's time, and
// the largest over the smallest (1.0 is perfect balance; contiguous
// sharding gives the last rank about 2c - 1 times the first's blocks).
// Thread CPU time varies from run to run on a shared virtual machine (two
// runs of CP 4 head-tail here gave 1.38 and 1.03): each rank's figure is
// the median of --runs runs.
//
// memory: the activation peak of a training step of the Llama example's
// model (examples/llama; --layers 2 of its default width) on one sequence
// of --seq tokens, per rank at CP 2 and 4 (ring attention, head-tail),
// against one process twice: with the example's plain attention (the
// whole sequence's scores kept for the backward) and with ring attention's
// blockwise softmax alone (a group of one rank), so that the ratio shows
// what splitting the sequence saves apart from what the attention
// algorithm saves. The peak is the largest rank's VmHWM during one step
// minus its RSS before it (one warm-up step first, Adam's state then
// allocated), with malloc returning every block of 64 KiB or more to the
// kernel when freed; the median of --runs runs.
//
//   dtrain-bench cp [--run balance,memory] [--seq 4096] [--heads 8] [--kv-heads 2] [--dim 64]
//                   [--layers 2] [--steps 2] [--runs 3]

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <string>
#include <vector>

#include <fstream>

#include "bench_util.h"
#include "dtrain/context_parallel.h"
#include "dtrain/dtrain.h"
#include "model.h"
#include "ranks.h"

namespace dtrain::bench {
namespace cp_balance {  // (named: dtrain-bench is a unity build)

namespace cp = context_parallel;

double thread_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// context-balance: this rank's thread time per pass; rank 0 prints every rank's.
int rank_main(const Args& a) {
  init_process_group(InitOptions().backend("tcp"));
  torch::set_num_threads(1);
  auto g = default_group();
  const auto sharding = a.get("sharding", "head-tail") == "contiguous" ? cp::Sharding::kContiguous
                                                                       : cp::Sharding::kHeadTail;
  const int64_t seq = a.num("seq", 4096), heads = a.num("heads", 8), kv_heads = a.num("kv-heads", 2),
                dim = a.num("dim", 64);
  torch::manual_seed(1);
  const auto whole = [&](int64_t h) { return torch::randn({1, h, seq, dim}); };
  const auto part = [&](const at::Tensor& t) { return cp::shard_sequence(t, 2, g, sharding).contiguous(); };
  auto q = part(whole(heads)).requires_grad_(true), k = part(whole(kv_heads)).requires_grad_(true),
       v = part(whole(kv_heads)).requires_grad_(true);
  const auto pass = [&] { cp::ring_attention(q, k, v, g, true, sharding).sum().backward(); };
  pass();
  const int steps = a.num("steps", 2);
  const double start = thread_seconds();
  for (int i = 0; i < steps; ++i) pass();
  auto mine = torch::full({1}, (thread_seconds() - start) / steps, torch::kDouble);
  auto all = torch::empty({g->size()}, torch::kDouble);
  g->all_gather_into_tensor(all, mine)->wait();
  if (g->rank() == 0) {
    std::printf("result");
    for (int r = 0; r < g->size(); ++r) std::printf(" rank%d=%.4f", r, all[r].item<double>());
    std::printf(" ratio=%.4f\n", all.max().item<double>() / all.min().item<double>());
  }
  destroy_process_group();
  return 0;
}

// context-memory: one training step of the Llama model on this rank's part
// of one sequence (--attention plain: the example's attention, one process
// only; ring: ring attention over the world, one rank included); rank 0
// prints the largest rank's activation peak and step time.
int memory_rank(const Args& a) {
  init_process_group(InitOptions().backend("tcp"));
  torch::set_num_threads(1);
  const auto world = default_group();
  const int rank = world->rank();
  std::shared_ptr<ProcessGroup> alone;  // each rank's tensor-parallel group: itself
  for (int r = 0; r < world->size(); ++r) {
    auto g = new_group({r});
    if (r == rank) alone = g;
  }
  llama::Config c;
  c.seq = a.num("seq", 4096);
  c.layers = a.num("layers", 2);
  const bool ring = a.get("attention", "ring") == "ring";
  auto layout = llama::Layout::over(alone);
  layout.cp = ring ? world : nullptr;
  llama::Stage model(c, layout, llama::initial_values(c, 0, 0, c.layers, true, true), 0, c.layers, true, true);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto gen = at::detail::createCPUGenerator(5);
  const auto rows = at::randint(c.vocab, {1, c.seq + 1}, gen, torch::kLong);
  const auto part = [&](const at::Tensor& t) { return ring ? cp::shard_sequence(t, 1, world) : t; };
  const auto input = part(rows.narrow(1, 0, c.seq)), target = part(rows.narrow(1, 1, c.seq));
  auto step = [&] {
    opt.zero_grad();
    llama::loss(model(input), target, alone).backward();
    opt.step();
  };
  step();
  { std::ofstream("/proc/self/clear_refs") << "5"; }  // VmHWM := VmRSS
  const int64_t resting = vm_status_bytes("VmRSS:");
  const auto t0 = std::chrono::steady_clock::now();
  step();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  auto mine = torch::tensor({static_cast<double>(vm_status_bytes("VmHWM:") - resting), ms}, torch::kDouble);
  world->all_reduce(mine, ReduceOp::MAX)->wait();
  if (rank == 0) std::printf("result activations=%.0f step_ms=%.1f\n", mine[0].item<double>(), mine[1].item<double>());
  destroy_process_group();
  return 0;
}

}  // namespace cp_balance

bool is_cp_mode(const std::string& mode) { return mode == "context-balance" || mode == "context-memory"; }

int cp_rank_main(const std::string& mode, const Args& a) {
  return mode == "context-memory" ? cp_balance::memory_rank(a) : cp_balance::rank_main(a);
}

namespace {

void report_memory(const Args& a) {
  const int runs = a.num("runs", 3);
  struct Row {
    const char* what;
    int world;
    const char* attention;
    std::vector<double> bytes, ms;
  };
  std::vector<Row> rows{{"one process, plain attention", 1, "plain", {}, {}},
                        {"one process, ring attention", 1, "ring", {}, {}},
                        {"CP 2, ring attention", 2, "ring", {}, {}},
                        {"CP 4, ring attention", 4, "ring", {}, {}}};
  for (int run = 0; run < runs; ++run)
    for (auto& r : rows) {  // alternating, so that drift hits every row
      Args args = a;
      args.flags["attention"] = r.attention;
      const std::string out = run_ranks(r.world, "context-memory", args, nullptr, "MALLOC_MMAP_THRESHOLD_=65536");
      r.bytes.push_back(field(out, "activations"));
      r.ms.push_back(field(out, "step_ms"));
    }
  std::printf("activation peak of a training step: the Llama example's model, %d layers, one sequence of %d "
              "tokens, largest rank, one thread per rank, medians of %d runs\n",
              a.num("layers", 2), a.num("seq", 4096), runs);
  const double plain = median(rows[0].bytes), blockwise = median(rows[1].bytes);
  for (auto& r : rows)
    std::printf("  %-30s %9.1f MiB  %.3fx plain  %.3fx ring  step %8.1f ms\n", r.what, median(r.bytes) / (1 << 20),
                median(r.bytes) / plain, median(r.bytes) / blockwise, median(r.ms));
}

void report_balance(const Args& a) {
  const int runs = a.num("runs", 3);
  std::printf("ring attention's balance: causal, sequence %d, %d q heads, %d kv heads, head dim %d; thread CPU "
              "seconds per forward and backward, one thread per rank, medians of %d runs\n",
              a.num("seq", 4096), a.num("heads", 8), a.num("kv-heads", 2), a.num("dim", 64), runs);
  for (int world : {2, 4}) {
    for (const std::string sharding : {"contiguous", "head-tail"}) {
      Args args = a;
      args.flags["sharding"] = sharding;
      std::vector<std::vector<double>> seconds(static_cast<size_t>(world));
      for (int run = 0; run < runs; ++run) {
        const std::string out = run_ranks(world, "context-balance", args);
        for (int r = 0; r < world; ++r) seconds[static_cast<size_t>(r)].push_back(field(out, "rank" + std::to_string(r)));
      }
      std::printf("  CP %d %-10s", world, sharding.c_str());
      double most = 0, least = 1e300;
      for (auto& s : seconds) {
        std::sort(s.begin(), s.end());
        const double m = s[s.size() / 2];
        most = std::max(most, m);
        least = std::min(least, m);
        std::printf(" %7.3f", m);
      }
      std::printf("   max/min %.3f\n", most / least);
    }
  }
}

}  // namespace

int bench_cp(const Args& a) {
  const std::string run = a.get("run", "balance,memory");
  if (run.find("balance") != std::string::npos) report_balance(a);
  if (run.find("memory") != std::string::npos) report_memory(a);
  return 0;
}

}  // namespace dtrain::bench
