// dtrain-bench cp: how evenly ring attention (context_parallel.h) spreads
// causal attention's work over the ranks of a CP group, with head-tail
// sharding against contiguous, at CP 2 and 4.
//
// Each rank (a process, one intra-op thread) runs --steps forward and
// backward passes of causal ring attention over its part of a sequence of
// --seq tokens (--heads q heads, --kv-heads kv heads, head dim --dim, batch
// 1) after one warm-up pass, and reports the CPU time of its own thread
// (the blocks' compute; the transport's I/O threads and waiting are not
// in it). Printed per CP size and sharding: every rank's time, and the
// largest over the smallest (1.0 is perfect balance; contiguous sharding
// gives the last rank about 2c - 1 times the first's blocks).
//
//   dtrain-bench cp [--seq 4096] [--heads 8] [--kv-heads 2] [--dim 64] [--steps 2] [--runs 3]
//
// Thread CPU time varies from run to run on a shared virtual machine
// (two runs of CP 4 head-tail here gave 1.38 and 1.03): each rank's
// figure is the median of --runs runs.

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <string>
#include <vector>

#include "dtrain/context_parallel.h"
#include "dtrain/dtrain.h"
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

}  // namespace cp_balance

bool is_cp_mode(const std::string& mode) { return mode == "context-balance"; }

int cp_rank_main(const Args& a) { return cp_balance::rank_main(a); }

int bench_cp(const Args& a) {
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
  return 0;
}

}  // namespace dtrain::bench
