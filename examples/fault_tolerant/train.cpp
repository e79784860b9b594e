// Fashion-MNIST trained by replica groups that survive each other's deaths
// (dtrain/ft/manager.h, docs/fault-tolerance.md). On one machine, three
// replica groups of two ranks and their lighthouse:
//
//   dtrain-run --replicas 3 --nproc-per-node 2 --max-restarts 3 dtrain-ft-fashion-mnist
//
// On several hosts each replica is launched as usual, with a lighthouse
// beside them:
//
//   dtrain-lighthouse --port 29510 &
//   # on each host, with its replica's id:
//   DTRAIN_FT_LIGHTHOUSE=host0:29510 DTRAIN_FT_REPLICA_ID=replica-<k> dtrain-run --nproc-per-node 2
//       --max-restarts 3 dtrain-ft-fashion-mnist
//
// A replica's workers may be killed (--die-after-steps, --die-every: all
// of them, by SIGKILL): its dtrain-run restarts them, they heal from
// a live replica and commit again; the others never stop. Or they may go
// silent mid-step (--stop-at-step: SIGSTOP, as a lost host leaves its
// connections open): the lighthouse declares the replica dead after its
// heartbeat timeout and the others go on; a SIGCONT lets it heal and
// rejoin. Inside a replica the model is DDP's, or FSDP's with --fsdp
// (FT-HSDP). --baseline-snapshot-every trains the same job without fault
// tolerance, for comparison (bench/scripts/ft_kills_netns.sh).

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <thread>

#include "dtrain/checkpoint/snapshot.h"
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

struct Flags {
  int replica_index = 0, batch = 32, log_every = 50, step_ms = 0, min_replicas = 1;
  int64_t steps = 300, die_after_steps = -1, stop_at_step = -1, baseline_snapshot_every = 0;
  bool fixed_batch = false, fsdp = false;
  std::string lighthouse, commit_log, faulty_replica, data = dtrain::FashionMNIST::kDefaultRoot;
  double lr = 0.05, die_every_s = 0;
};

// The tensors' bytes, hashed (64-bit FNV-1a): equal on replicas whose
// states are bitwise equal.
std::string hash_of(const std::vector<torch::Tensor>& tensors) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& p : tensors) {
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

// Sample i of the job is sample order_e[i mod N] of epoch e = i / N, in a
// seeded order that every replica draws alike.
class SampleOrder {
 public:
  explicit SampleOrder(const dtrain::FashionMNIST& train) : train_(train) {}
  std::pair<torch::Tensor, torch::Tensor> batch(int64_t first, int64_t count) {
    const int64_t n = dtrain::FashionMNIST::kTrainSize;
    std::vector<int64_t> idx;
    for (int64_t i = first; i < first + count; ++i) {
      if (i / n != epoch_) {
        epoch_ = i / n;
        torch::manual_seed(1000 + epoch_);
        order_ = torch::randperm(n, torch::kLong);
      }
      idx.push_back(order_[i % n].item<int64_t>());
    }
    auto index = torch::tensor(idx, torch::kLong);
    return {train_.images().index_select(0, index), train_.targets().index_select(0, index)};
  }

 private:
  const dtrain::FashionMNIST& train_;
  int64_t epoch_ = -1;
  torch::Tensor order_;
};

std::string replace_all(std::string text, const std::string& from, const std::string& to) {
  for (size_t at = 0; (at = text.find(from, at)) != std::string::npos; at += to.size()) text.replace(at, from.size(), to);
  return text;
}

// "<step> <hash> <unix ms> <first sample> <samples> <quorum id> <members>",
// appended.
void log_commit(const std::string& path, int64_t step, const std::string& hash, const dtrain::ft::StepSamples& s,
                const std::string& quorum, const std::string& members) {
  if (path.empty()) return;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
  std::ofstream(path, std::ios::app) << step << " " << hash << " " << ms << " " << s.step_first << " "
                                     << s.step_count << " " << quorum << " " << members << std::endl;
}

// The model as this run wraps it (DDP or FSDP), its optimizer and its state.
struct Wrapped {
  std::function<torch::Tensor(torch::Tensor)> forward;
  std::function<std::string()> hash;  // this rank's parameters (its shards under FSDP)
  std::unique_ptr<torch::optim::SGD> opt;
  std::shared_ptr<void> holder;
};

// DDP (its gradients through `hook`), or FSDP over `fsdp_options`; `state`
// gets what a healing or restoring rank takes.
Wrapped wrap(Mlp net, const Flags& f, const dtrain::CommHook& hook, const dtrain::FSDPOptions& fsdp_options,
             dtrain::checkpoint::DistributedState& state) {
  Wrapped w;
  const auto sgd = torch::optim::SGDOptions(f.lr).momentum(0.9);
  if (f.fsdp) {
    auto fsdp = std::make_shared<dtrain::FullyShardedDataParallel<MlpImpl>>(net.ptr(), fsdp_options);
    w.opt = std::make_unique<torch::optim::SGD>(fsdp->parameters(), sgd);
    dtrain::checkpoint::add_fsdp(state, *fsdp, *w.opt);
    w.forward = [fsdp](torch::Tensor x) { return fsdp->forward(x); };
    w.hash = [fsdp] { return hash_of(fsdp->parameters()); };
    w.holder = fsdp;
    return w;
  }
  auto ddp = std::make_shared<dtrain::DistributedDataParallel<MlpImpl>>(net.ptr());
  if (hook) ddp->register_comm_hook(hook);
  w.opt = std::make_unique<torch::optim::SGD>(net->parameters(), sgd);
  dtrain::checkpoint::add_module(state, *net);
  dtrain::checkpoint::add_optimizer(state, *w.opt, *net);
  w.forward = [ddp](torch::Tensor x) { return ddp->forward(x); };
  w.hash = [net] { return hash_of(net->parameters()); };
  w.holder = ddp;
  return w;
}

// Fault injection, in the replica --faulty-replica names (default: this
// one): --die-after-steps (SIGKILL, first life, once it has committed that
// many steps) and --die-every (SIGKILL, every life, that long after its
// first commit) before a step's quorum; --stop-at-step (SIGSTOP, once, at
// the first step at or past it whose quorum holds another replica and is
// the previous step's, so that its silence holds up a replica already
// training with it, not one healing from it: a replica may heal past the
// step, and one that started alone may commit steps in a quorum of its own
// first) after it.
// Counted in this replica's own steps and time, so that where it joined the
// job does not matter.
struct Faults {
  Flags& f;
  const std::string& replica;
  int rank;
  bool first_life;
  int64_t committed = 0;
  std::optional<std::chrono::steady_clock::time_point> first_commit;
  std::string last_quorum;  // the previous step's, for --stop-at-step

  bool mine() const { return f.faulty_replica.empty() || f.faulty_replica == replica; }
  void committed_one() {
    ++committed;
    if (!first_commit) first_commit = std::chrono::steady_clock::now();
  }
  void before_quorum(int64_t step) const {
    if (!mine()) return;
    const bool steps_up = first_life && f.die_after_steps >= 0 && committed >= f.die_after_steps;
    const bool time_up = f.die_every_s > 0 && first_commit &&
                         std::chrono::steady_clock::now() - *first_commit >= std::chrono::duration<double>(f.die_every_s);
    if (!steps_up && !time_up) return;
    std::cout << replica << " rank " << rank << ": dying after " << committed << " committed steps, at step " << step
              << (steps_up ? " (--die-after-steps)" : " (--die-every)") << std::endl;
    std::raise(SIGKILL);
  }
  void after_quorum(int64_t step, const dtrain::ft::QuorumInfo& q) {
    const bool steady = q.id == last_quorum;
    last_quorum = q.id;
    if (!mine() || f.stop_at_step < 0 || step < f.stop_at_step || q.members.size() < 2 || !steady) return;
    f.stop_at_step = -1;
    std::cout << replica << " rank " << rank << ": going silent at step " << step << " (--stop-at-step)" << std::endl;
    std::raise(SIGSTOP);
  }
};

std::string why_not_committed(const dtrain::ft::Manager& manager) {
  try {
    if (auto e = manager.errored()) std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
  return "no quorum";
}

int run_replica(Flags f, const dtrain::FashionMNIST& train) {
  const int rank = dtrain::get_rank();
  const std::string replica = std::getenv("DTRAIN_FT_REPLICA_ID") ? std::getenv("DTRAIN_FT_REPLICA_ID")
                                                                   : "replica-" + std::to_string(f.replica_index);
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  Faults faults{f, replica, rank, !restarts || std::string(restarts) == "0", 0, std::nullopt, {}};
  const std::string commit_log = replace_all(f.commit_log, "%r", replica);
  torch::manual_seed(f.replica_index);  // replicas start apart: the first quorum syncs them (init_sync)
  Mlp net;
  dtrain::checkpoint::DistributedState state;  // filled by wrap(), before the first quorum
  // A synchronous quorum: a replica that heals does so before its forward,
  // so every member trains its share and each sample is trained once.
  dtrain::ft::Manager manager(state, dtrain::ft::ManagerOptions()
                                         .lighthouse(f.lighthouse)
                                         .replica_id(replica)
                                         .async_quorum(false)
                                         .min_replicas(f.min_replicas)
                                         .world_size_mode(f.fixed_batch ? dtrain::ft::WorldSizeMode::kFixedWithSpares
                                                                        : dtrain::ft::WorldSizeMode::kDynamic));
  auto model = wrap(net, f, dtrain::ft::allreduce_hook(manager),
                    dtrain::FSDPOptions()
                        .process_group(dtrain::default_group())
                        .replicate_average(dtrain::ft::replicate_average(manager)),
                    state);
  SampleOrder order(train);
  int64_t uncommitted = 0, loss_count = 0;
  double loss_sum = 0;
  while (manager.current_step() < f.steps) {
    const auto started = std::chrono::steady_clock::now();
    const int64_t step = manager.current_step();
    faults.before_quorum(step);
    manager.start_quorum();
    faults.after_quorum(manager.current_step(), manager.quorum());
    const auto samples = manager.step_samples(f.batch);
    // A spare's share is empty: its gradients count as zeros, any batch will do.
    auto [x, y] = order.batch(samples.first, samples.count > 0 ? samples.count : f.batch);
    model.opt->zero_grad();
    auto loss = torch::cross_entropy_loss(model.forward(x), y);
    loss.backward();
    if (manager.should_commit()) {
      model.opt->step();
      faults.committed_one();
      loss_sum += loss.item<double>();
      ++loss_count;
      const auto q = manager.quorum();
      if (rank == 0) log_commit(commit_log, manager.current_step(), model.hash(), samples, q.id, members_text(q.members));
      if (rank == 0 && (manager.current_step() % f.log_every == 0 || q.healing)) {
        std::cout << replica << ": step " << manager.current_step() << " committed, quorum of " << q.members.size()
                  << " (" << members_text(q.members) << ")" << (q.healing ? ", healed" : "")
                  << (q.participating ? "" : ", spare") << ", loss " << loss_sum / loss_count << ", " << uncommitted
                  << " not committed so far" << std::endl;
        loss_sum = 0;
        loss_count = 0;
      }
    } else {
      ++uncommitted;
      if (rank == 0) std::cout << replica << ": step " << step << " not committed: " << why_not_committed(manager) << std::endl;
    }
    std::this_thread::sleep_until(started + std::chrono::milliseconds(f.step_ms));
  }
  if (rank == 0)
    std::cout << replica << ": done, " << manager.current_step() << " steps committed, " << uncommitted
              << " not committed, state " << model.hash() << std::endl;
  return 0;
}

// The same training without fault tolerance: every node's dtrain-run one
// job (HSDP over nodes x ranks with --fsdp, else DDP), a snapshot in
// peers' memory every N steps, resumed from after a restart.
int run_baseline(const Flags& f, const dtrain::FashionMNIST& train) {
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  const int per_node = local ? std::stoi(local) : world;
  torch::manual_seed(0);
  Mlp net;
  dtrain::checkpoint::DistributedState state;
  auto mesh = dtrain::init_device_mesh({world / per_node, per_node}, {"replicate", "shard"});
  auto model = wrap(net, f, nullptr, dtrain::FSDPOptions().mesh(mesh), state);
  int64_t start = 0;
  if (auto step = dtrain::checkpoint::restore_snapshot(state)) start = *step + 1;
  if (rank == 0) std::cout << "baseline: " << (start ? "resumed at step " + std::to_string(start) : "fresh start") << std::endl;
  SampleOrder order(train);
  dtrain::checkpoint::AsyncSnapshot pending;
  const int64_t global = static_cast<int64_t>(f.batch) * world;
  for (int64_t step = start; step < f.steps; ++step) {
    dtrain::ft::StepSamples s;
    s.step_first = step * global;
    s.step_count = global;
    auto [x, y] = order.batch(s.step_first + static_cast<int64_t>(rank) * f.batch, f.batch);
    model.opt->zero_grad();
    torch::cross_entropy_loss(model.forward(x), y).backward();
    model.opt->step();
    if (rank == 0) log_commit(f.commit_log, step + 1, model.hash(), s, "job", "job");
    if ((step + 1) % f.baseline_snapshot_every == 0) pending = dtrain::checkpoint::async_snapshot(step, state);
  }
  if (pending.valid()) pending.wait();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Fashion-MNIST trained by fault-tolerant replica groups (run each replica under dtrain-run)"};
  Flags f;
  app.add_option("--replica-index", f.replica_index, "this replica's number: its id is replica-<k>, its seed k");
  app.add_option("--lighthouse", f.lighthouse, "host:port of dtrain-lighthouse (default: DTRAIN_FT_LIGHTHOUSE)");
  app.add_option("--steps", f.steps, "steps to commit")->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--batch", f.batch, "samples per rank and step")->check(CLI::Range(1, 1 << 16));
  app.add_option("--lr", f.lr, "SGD learning rate (momentum 0.9)");
  app.add_option("--min-replicas", f.min_replicas, "steps commit only with at least this many replicas")
      ->check(CLI::Range(1, 1 << 16));
  app.add_flag("--fixed-batch", f.fixed_batch,
               "exactly --min-replicas replicas train each step (a fixed global batch); the others are spares that "
               "stand in when one dies (torchft's FIXED_WITH_SPARES)");
  app.add_flag("--fsdp", f.fsdp, "FSDP inside each replica, sharded over its ranks (FT-HSDP); default DDP");
  app.add_option("--die-after-steps", f.die_after_steps,
                 "fault injection: every worker of this replica kills itself (SIGKILL) once it has committed this many "
                 "steps, in its first life")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--die-every", f.die_every_s,
                 "fault injection: every worker of this replica kills itself (SIGKILL) this many seconds after its "
                 "life's first commit, in every life (with dtrain-run --max-restarts: a death every so often)")
      ->check(CLI::PositiveNumber);
  app.add_option("--faulty-replica", f.faulty_replica,
                 "the replica (its id, say replica-2) that the fault-injection flags apply to; default: this one "
                 "(for dtrain-run --replicas, where every replica gets the same flags)");
  app.add_option("--stop-at-step", f.stop_at_step,
                 "fault injection: every worker of this replica stops itself (SIGSTOP) once its quorum formed, at the "
                 "first step at or past this one whose quorum holds another replica and was the previous step's, once; "
                 "SIGCONT resumes it");
  app.add_option("--step-ms", f.step_ms, "pad each step to at least this many milliseconds (to watch it live)")
      ->check(CLI::Range(0, 60000));
  app.add_option("--log-every", f.log_every, "a progress line every this many steps")->check(CLI::Range(1, 1 << 30));
  app.add_option("--commit-log", f.commit_log,
                 "append '<step> <state hash> <unix ms> <first sample> <samples> <quorum id> <members>' here at each "
                 "commit (rank 0); %r in it becomes the replica's id");
  app.add_option("--baseline-snapshot-every", f.baseline_snapshot_every,
                 "for comparison, no fault tolerance: every node's dtrain-run is one job (HSDP over nodes x ranks "
                 "with --fsdp), a snapshot in peers' memory every N steps, resumed from after a restart")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--data", f.data, "Fashion-MNIST's directory");
  CLI11_PARSE(app, argc, argv);
  try {
    dtrain::init_process_group();
    const dtrain::FashionMNIST train(f.data);
    const int code = f.baseline_snapshot_every > 0 ? run_baseline(f, train) : run_replica(f, train);
    dtrain::destroy_process_group();
    return code;
  } catch (const dtrain::Error& e) {
    std::cerr << "dtrain-ft-fashion-mnist: " << e.what() << std::endl;
    return 1;
  }
}
