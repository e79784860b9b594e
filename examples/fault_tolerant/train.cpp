// Fashion-MNIST trained by replica groups that survive each other's deaths
// (dtrain/ft/manager.h, docs/fault-tolerance.md). Each replica is launched
// as usual, with a lighthouse beside them:
//
//   dtrain-lighthouse --port 29510 &
//   for k in 0 1 2; do
//     dtrain-run --nproc-per-node 2 --max-restarts 3 --master-port $((29600 + k))
//       dtrain-ft-fashion-mnist --replica-index $k --lighthouse 127.0.0.1:29510 &
//   done
// (one command per replica; docs/fault-tolerance.md has it whole)
//
// A replica's workers may be killed (--die-at-step: all of them, by
// SIGKILL, in its first life): its dtrain-run restarts them, they heal from
// a live replica and commit again; the others never stop. Or they may go
// silent mid-step (--stop-at-step: SIGSTOP, as a lost host leaves its
// connections open): the lighthouse declares the replica dead after its
// heartbeat timeout and the others go on; a SIGCONT lets it heal and
// rejoin.

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <thread>

#include "dtrain/data/fashion_mnist.h"
#include "dtrain/dtrain.h"

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(28 * 28, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x.flatten(1)))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Mlp);

// The parameters' bytes, hashed (64-bit FNV-1a): equal on replicas whose
// states are bitwise equal.
std::string state_hash(torch::nn::Module& m) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& p : m.parameters()) {
    auto t = p.detach().contiguous();
    const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
    for (size_t i = 0; i < t.nbytes(); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

std::string members_text(const std::vector<std::string>& members) {
  std::string out;
  for (const auto& m : members) out += (out.empty() ? "" : " ") + m;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Fashion-MNIST trained by fault-tolerant replica groups (run each replica under dtrain-run)"};
  int replica_index = 0, batch = 32, log_every = 50, step_ms = 0, min_replicas = 1;
  bool fixed_batch = false;
  int64_t steps = 300, die_at_step = -1, stop_at_step = -1;
  std::string lighthouse, commit_log, data = dtrain::FashionMNIST::kDefaultRoot;
  double lr = 0.05;
  app.add_option("--replica-index", replica_index, "this replica's number: its id is replica-<k>, its seed k");
  app.add_option("--lighthouse", lighthouse, "host:port of dtrain-lighthouse (default: DTRAIN_FT_LIGHTHOUSE)");
  app.add_option("--steps", steps, "steps to commit")->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--batch", batch, "samples per rank and step")->check(CLI::Range(1, 1 << 16));
  app.add_option("--lr", lr, "SGD learning rate (momentum 0.9)");
  app.add_option("--min-replicas", min_replicas, "steps commit only with at least this many replicas")
      ->check(CLI::Range(1, 1 << 16));
  app.add_flag("--fixed-batch", fixed_batch,
               "exactly --min-replicas replicas train each step (a fixed global batch); the others are spares that "
               "stand in when one dies (torchft's FIXED_WITH_SPARES)");
  app.add_option("--die-at-step", die_at_step,
                 "fault injection: every worker of this replica kills itself (SIGKILL) at this step, in its first life");
  app.add_option("--stop-at-step", stop_at_step,
                 "fault injection: every worker of this replica stops itself (SIGSTOP) at this step once its quorum "
                 "formed, once; SIGCONT resumes it");
  app.add_option("--step-ms", step_ms, "pad each step to at least this many milliseconds (to watch it live)")
      ->check(CLI::Range(0, 60000));
  app.add_option("--log-every", log_every, "a progress line every this many steps")->check(CLI::Range(1, 1 << 30));
  app.add_option("--commit-log", commit_log,
                 "append '<step> <state hash> <unix ms> <first sample> <samples> <members>' here at each commit "
                 "(rank 0)");
  app.add_option("--data", data, "Fashion-MNIST's directory");
  CLI11_PARSE(app, argc, argv);
  try {
    dtrain::init_process_group();
    const int rank = dtrain::get_rank();
    const std::string replica =
        std::getenv("DTRAIN_FT_REPLICA_ID") ? std::getenv("DTRAIN_FT_REPLICA_ID") : "replica-" + std::to_string(replica_index);
    const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
    const bool first_life = !restarts || std::string(restarts) == "0";

    dtrain::FashionMNIST train(data);
    torch::manual_seed(replica_index);  // replicas start apart: the first quorum syncs them (init_sync)
    Mlp net;
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(lr).momentum(0.9));
    dtrain::checkpoint::DistributedState state;
    dtrain::checkpoint::add_module(state, *net);
    dtrain::checkpoint::add_optimizer(state, opt, *net);
    // A synchronous quorum: a replica that heals does so before its forward,
    // so every member trains its share and each sample is trained once.
    dtrain::ft::Manager manager(state, dtrain::ft::ManagerOptions()
                                           .lighthouse(lighthouse)
                                           .replica_id(replica)
                                           .async_quorum(false)
                                           .min_replicas(min_replicas)
                                           .world_size_mode(fixed_batch ? dtrain::ft::WorldSizeMode::kFixedWithSpares
                                                                        : dtrain::ft::WorldSizeMode::kDynamic));
    dtrain::DistributedDataParallel ddp(net);
    ddp.register_comm_hook(dtrain::ft::allreduce_hook(manager));

    // Sample i of the job is sample order_e[i mod N] of epoch e = i / N, in
    // a seeded order that every replica draws alike; the manager hands each
    // rank its share of each step, every sample in one committed step.
    const int64_t n = dtrain::FashionMNIST::kTrainSize;
    int64_t order_epoch = -1;
    torch::Tensor order;
    auto batch_of = [&](const dtrain::ft::StepSamples& s) {
      std::vector<int64_t> idx;
      for (int64_t i = s.first; i < s.first + s.count; ++i) {
        if (i / n != order_epoch) {
          order_epoch = i / n;
          torch::manual_seed(1000 + order_epoch);
          order = torch::randperm(n, torch::kLong);
        }
        idx.push_back(order[i % n].item<int64_t>());
      }
      auto index = torch::tensor(idx, torch::kLong);
      return std::make_pair(train.images().index_select(0, index), train.targets().index_select(0, index));
    };

    int64_t uncommitted = 0;
    double loss_sum = 0;
    int loss_count = 0;
    while (manager.current_step() < steps) {
      const auto started = std::chrono::steady_clock::now();
      const int64_t step = manager.current_step();
      if (first_life && step == die_at_step) {
        std::cout << replica << " rank " << rank << ": dying at step " << step << " (--die-at-step)" << std::endl;
        std::raise(SIGKILL);
      }
      manager.start_quorum();
      if (step == stop_at_step) {
        stop_at_step = -1;
        std::cout << replica << " rank " << rank << ": going silent at step " << step << " (--stop-at-step)"
                  << std::endl;
        std::raise(SIGSTOP);
      }
      const auto samples = manager.step_samples(batch);
      auto share = samples;
      if (share.count == 0) share.count = batch;  // a spare: its gradients count as zeros, any batch will do
      auto [x, y] = batch_of(share);
      opt.zero_grad();
      auto loss = torch::cross_entropy_loss(ddp.forward(x), y);
      loss.backward();
      if (manager.should_commit()) {
        opt.step();
        loss_sum += loss.item<double>();
        ++loss_count;
        const auto q = manager.quorum();
        if (rank == 0 && !commit_log.empty()) {
          std::ofstream(commit_log, std::ios::app)
              << manager.current_step() << " " << state_hash(*net) << " "
              << std::chrono::duration_cast<std::chrono::milliseconds>(
                     std::chrono::system_clock::now().time_since_epoch())
                     .count()
              << " " << samples.step_first << " " << samples.step_count << " " << members_text(q.members) << std::endl;
        }
        if (rank == 0 && (manager.current_step() % log_every == 0 || q.healing)) {
          std::cout << replica << ": step " << manager.current_step() << " committed, quorum of "
                    << q.members.size() << " (" << members_text(q.members) << ")" << (q.healing ? ", healed" : "")
                    << (q.participating ? "" : ", spare")
                    << ", loss " << loss_sum / loss_count << ", " << uncommitted << " not committed so far"
                    << std::endl;
          loss_sum = 0;
          loss_count = 0;
        }
      } else {
        ++uncommitted;
        if (rank == 0) {
          auto e = manager.errored();
          std::string why = "no quorum";
          try {
            if (e) std::rethrow_exception(e);
          } catch (const std::exception& x) {
            why = x.what();
          }
          std::cout << replica << ": step " << step << " not committed: " << why << std::endl;
        }
      }
      std::this_thread::sleep_until(started + std::chrono::milliseconds(step_ms));
    }
    if (rank == 0)
      std::cout << replica << ": done, " << manager.current_step() << " steps committed, " << uncommitted
                << " not committed, state " << state_hash(*net) << std::endl;
    dtrain::destroy_process_group();
    return 0;
  } catch (const dtrain::Error& e) {
    std::cerr << "dtrain-ft-fashion-mnist: " << e.what() << std::endl;
    return 1;
  }
}
