// dtrain-bench ft [--replicas 2] [--ranks 2] [--steps 60] [--batch 64] [--runs 3]
//
// Fault tolerance's cost when nothing fails: the MNIST convnet trained by
// `replicas` replica groups of `ranks` ranks under FT-DDP (ft::Manager
// around a lighthouse in this process: a quorum per step, the gradients
// averaged inside the replica, then over the cross-replica group, and the
// commit vote) against plain DDP over the same replicas x ranks processes,
// interleaved runs. Each replica's ranks share a "host" (DTRAIN_HOST_ID), so
// plain DDP runs auto's two levels (shared memory inside a host, tcp
// between) and FT-DDP the same: shared memory inside a replica, tcp across.

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "bench_util.h"
#include "dtrain/dtrain.h"
#include "models.h"
#include "ranks.h"

namespace dtrain::bench {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

bool is_ft_mode(const std::string& mode) { return mode == "ft-ddp" || mode == "ft-plain"; }

int ft_rank_main(const std::string& mode, const Args& a) {
  torch::set_num_threads(1);
  const int ranks = a.num("ranks", 2), rank = std::atoi(std::getenv("RANK"));
  const std::string host = "ft-bench-host-" + std::to_string(rank / ranks);
  setenv("DTRAIN_HOST_ID", host.c_str(), 1);
  dtrain::init_process_group();
  const int steps = a.num("steps", 60), batch = a.num("batch", 64);
  torch::manual_seed(0);
  auto net = MnistNet();
  auto x = torch::randn({batch, 1, 28, 28});
  auto y = torch::randint(0, 10, {batch});
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  std::function<void()> step;
  std::unique_ptr<DistributedDataParallel<MnistNetImpl>> ddp;
  std::unique_ptr<ft::Manager> manager;
  checkpoint::DistributedState state;
  if (mode == "ft-plain") {
    ddp = std::make_unique<DistributedDataParallel<MnistNetImpl>>(net.ptr());
    step = [&] {
      opt.zero_grad();
      torch::nll_loss(ddp->forward(x), y).backward();
      opt.step();
    };
  } else {
    auto replica = new_subgroups(ranks).first;
    const std::string id = "replica-" + std::to_string(rank / ranks);
    checkpoint::add_module(state, *net);
    checkpoint::add_optimizer(state, opt, *net);
    manager = std::make_unique<ft::Manager>(
        state, ft::ManagerOptions()
                   .lighthouse(a.get("lighthouse", ""))
                   .replica_id(id)
                   .group(replica)
                   .store(std::make_shared<PrefixStore>(id + "/", default_store()))
                   .init_sync(false));
    ddp = std::make_unique<DistributedDataParallel<MnistNetImpl>>(net.ptr(), DDPOptions().process_group(replica));
    ddp->register_comm_hook(ft::allreduce_hook(*manager));
    step = [&] {
      manager->start_quorum();
      opt.zero_grad();
      torch::nll_loss(ddp->forward(x), y).backward();
      if (manager->should_commit()) opt.step();
    };
  }
  for (int i = 0; i < 5; ++i) step();  // warm-up (and DDP's bucket rebuild)
  barrier();
  const auto t0 = Clock::now();
  for (int i = 0; i < steps; ++i) step();
  barrier();
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (rank == 0) {
    std::printf("step_ms=%.4f\n", 1000 * seconds / steps);
    if (manager) std::printf("committed=%lld\n", static_cast<long long>(manager->current_step()));
  }
  destroy_process_group();
  return 0;
}

int bench_ft(const Args& a) {
  const int replicas = a.num("replicas", 2), ranks = a.num("ranks", 2), runs = a.num("runs", 3);
  const int steps = a.num("steps", 60), world = replicas * ranks;
  ft::Lighthouse lighthouse(ft::LighthouseOptions().port(0).min_replicas(replicas));
  Args rank_args;
  rank_args.flags = {{"steps", std::to_string(steps)},
                     {"batch", a.get("batch", "64")},
                     {"ranks", std::to_string(ranks)},
                     {"lighthouse", lighthouse.address()}};
  std::printf("# %d replicas x %d ranks, MNIST convnet, batch %s per rank, %d steps; a host per replica\n",
              replicas, ranks, a.get("batch", "64").c_str(), steps);
  std::printf("%-4s %14s %14s %10s %10s\n", "run", "ddp_step_ms", "ft_ddp_step_ms", "ft/ddp", "committed");
  std::vector<double> ratios;
  for (int r = 0; r < runs; ++r) {
    const double plain = field(run_ranks(world, "ft-plain", rank_args), "step_ms");
    const auto out = run_ranks(world, "ft-ddp", rank_args);
    const double ft = field(out, "step_ms");
    ratios.push_back(ft / plain);
    std::printf("%-4d %14.2f %14.2f %10.3f %10.0f\n", r, plain, ft, ft / plain, field(out, "committed"));
    std::fflush(stdout);
  }
  std::printf("median ft/ddp step time: %.3f\n", median(ratios));
  return 0;
}

}  // namespace dtrain::bench
