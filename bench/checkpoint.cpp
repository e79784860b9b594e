// dtrain-bench checkpoint: what a checkpoint costs training, synchronous
// save() beside async_save(), in the same ranks on the same state: a wide
// MLP (--layers square layers of --width, FSDP units) trained with Adam
// under DDP and under FSDP, --world ranks (4).
//
//   step          a training step without any save (median)
//   save          save(): training stops for all of it (median of --saves)
//   stall         async_save() until it returns: the copy of the rank's part
//                 into the staging buffers (median of --saves after the
//                 first; the first, which allocates them, apart). With
//                 --background-staging 1 the copy overlaps the next step's
//                 forward and backward; the stall is async_save's return
//                 plus what that step's update still waits for the copy
//   write         async_save() to its commit, training going on
//   step_during   a training step while the background writer runs (median)
//   snapshot      snapshot() into two keepers standing for two hosts (this
//                 process holds them): the whole of it stalls training
//
// Every figure is the slowest rank's. The ratios: stall / save (<= 0.15 is
// the goal), step_during / step (<= 1.1). bench/scripts/checkpoint_vs_pytorch.sh
// runs torch.distributed.checkpoint's save and async_save on the same
// model beside it.

#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <cstdio>
#include <memory>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/dtrain.h"
#include "bench_util.h"
#include "models.h"
#include "ranks.h"

namespace dtrain::bench {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A training step takes a hook run between its backward and its
// optimizer step.
using Hook = std::function<void()>;
const Hook kNoHook = [] {};

struct Figures {
  std::vector<double> step, save, stall, write, step_during, snapshot, async_snapshot;
  double first_stall = 0;
  int64_t state_bytes = 0, snapshot_sent = 0;
};

int64_t bytes_of(const checkpoint::DistributedState& state) {
  int64_t n = 0;
  for (const auto& [name, t] : state.replicated) n += static_cast<int64_t>(t.nbytes());
  for (const auto& [name, s] : state.sharded) n += static_cast<int64_t>(s.local.nbytes());
  return n;
}

// Steps, then --saves synchronous saves, then --saves + 1 asynchronous ones
// with training going on while each is written.
template <typename Step>
Figures measure_saves(const Args& a, const checkpoint::DistributedState& state, Step&& step) {
  const std::string dir = a.get("dir", "/tmp/dtrain-bench-checkpoint");
  const int saves = a.num("saves", 3);
  Figures f;
  f.state_bytes = bytes_of(state);
  step(kNoHook);  // warm-up
  for (int i = 0; i < a.num("steps", 5); ++i) {
    barrier();
    const auto t0 = Clock::now();
    step(kNoHook);
    f.step.push_back(since(t0));
  }
  for (int i = 0; i < saves; ++i) {
    barrier();
    const auto t0 = Clock::now();
    checkpoint::save(dir + "/sync", state);
    f.save.push_back(since(t0));
    step(kNoHook);
  }
  for (int i = 0; i <= saves; ++i) {
    barrier();
    const auto t0 = Clock::now();
    const bool background = a.num("background-staging", 0) != 0;
    auto pending = checkpoint::async_save(dir + "/async", state,
                                          checkpoint::AsyncSaveOptions().stage_in_background(background));
    double stall = since(t0);
    if (background) {  // the next step's forward and backward overlap the copy; its update waits for it
      const auto s0 = Clock::now();
      double waited = 0;
      step([&] {
        const auto w0 = Clock::now();
        pending.wait_staged();
        waited = since(w0);
      });
      stall += waited;
      f.step_during.push_back(since(s0) - waited);
    }
    if (i == 0)
      f.first_stall = stall;
    else
      f.stall.push_back(stall);
    // Steps until every rank's writer is done: the ranks agree after each
    // (their collectives must stay in step).
    auto writing = at::ones({1}, at::kInt);
    for (;;) {
      all_reduce(writing, AllReduceOptions().op(ReduceOp::MAX));
      if (writing.item<int>() == 0) break;
      const auto s0 = Clock::now();
      step(kNoHook);
      f.step_during.push_back(since(s0));
      writing.fill_(pending.done() ? 0 : 1);
    }
    f.write.push_back(since(t0));
    pending.wait();
  }
  // Snapshots in a peer's memory: ranks of the first half on "host" A's
  // keeper, the others on B's (the parent's two SnapshotKeepers).
  const std::string keepers = a.get("keepers", "");
  const int world = get_world_size();
  const auto keeper = get_rank() < world / 2 ? keepers.substr(0, keepers.find(',')) : keepers.substr(keepers.find(',') + 1);
  for (int i = 0; i <= saves && !keepers.empty(); ++i) {
    barrier();
    const auto t0 = Clock::now();
    const auto info = checkpoint::snapshot(i, state, checkpoint::SnapshotOptions().keeper_socket(keeper));
    if (i > 0) f.snapshot.push_back(since(t0));  // the first allocates the keepers' memory
    f.snapshot_sent = static_cast<int64_t>(info.sent_bytes);
    step(kNoHook);
  }
  for (int i = 0; i <= saves && !keepers.empty(); ++i) {
    barrier();
    const auto t0 = Clock::now();
    auto pending = checkpoint::async_snapshot(saves + 1 + i, state, checkpoint::SnapshotOptions().keeper_socket(keeper));
    if (i > 0) f.async_snapshot.push_back(since(t0));  // the first makes its group
    step(kNoHook);
    pending.wait();
  }
  return f;
}

// The slowest rank's median of each figure.
void report_figures(const Figures& f) {
  auto all = at::tensor({median(f.step), median(f.save), f.first_stall, median(f.stall), median(f.write),
                         median(f.step_during), static_cast<double>(f.step_during.size()),
                         static_cast<double>(f.state_bytes), f.snapshot.empty() ? 0.0 : median(f.snapshot),
                         static_cast<double>(f.snapshot_sent),
                         f.async_snapshot.empty() ? 0.0 : median(f.async_snapshot)},
                        at::kDouble);
  all_reduce(all, AllReduceOptions().op(ReduceOp::MAX));
  auto v = [&](int i) { return all[i].item<double>(); };
  if (get_rank() == 0)
    std::printf("result step=%.4f save=%.4f first_stall=%.4f stall=%.4f write=%.4f step_during=%.4f "
                "steps_during=%.0f state_bytes=%.0f snapshot=%.4f snapshot_sent=%.0f async_snapshot=%.4f\n",
                v(0), v(1), v(2), v(3), v(4), v(5), v(6), v(7), v(8), v(9), v(10));
}

// FSDP's weights exported whole, then imported into a fresh state of the
// same FSDP layout: each rank's peak resident memory during the import
// over what it had before (its peak reset first: /proc/self/clear_refs),
// beside its shard and the model. The slowest rank's.
template <typename Fsdp>
void report_import(const Args& a, Fsdp& fsdp, int64_t model_bytes) {
  const std::string out = a.get("dir", "/tmp/dtrain-bench-checkpoint") + "/hf";
  {
    checkpoint::DistributedState weights;
    checkpoint::add_fsdp_parameters(weights, fsdp);
    checkpoint::export_safetensors(out, weights);
  }
  int64_t shard = 0;
  for (const auto& s : fsdp.shard_layout()) shard += s.shard.nbytes();
  checkpoint::DistributedState into;
  checkpoint::add_fsdp_parameters(into, fsdp);
  barrier();
  std::ofstream("/proc/self/clear_refs") << "5";
  const int64_t resting = vm_status_bytes("VmRSS:");
  const auto t0 = Clock::now();
  checkpoint::import_safetensors(out, into);
  const double seconds = since(t0);
  auto all = at::tensor({static_cast<double>(vm_status_bytes("VmHWM:") - resting), static_cast<double>(shard),
                         seconds},
                        at::kDouble);
  all_reduce(all, AllReduceOptions().op(ReduceOp::MAX));
  if (get_rank() == 0)
    std::printf("result import_peak=%.0f shard=%.0f model=%.0f import_s=%.4f\n", all[0].item<double>(),
                all[1].item<double>(), static_cast<double>(model_bytes), all[2].item<double>());
}

}  // namespace

bool is_checkpoint_mode(const std::string& mode) { return mode.rfind("ckpt-", 0) == 0; }

int checkpoint_rank_main(const std::string& mode, const Args& a) {
  torch::set_num_threads(1);
  init_process_group(InitOptions().backend(a.get("backend", "auto")));
  const int width = a.num("width", 4096), batch = a.num("batch", 8);
  torch::manual_seed(0);
  std::shared_ptr<WideMlpImpl> net;
  {
    std::optional<ShardedConstruction> sharded;
    if (mode == "ckpt-fsdp") sharded.emplace();
    net = std::make_shared<WideMlpImpl>(a.num("layers", 6), width);
  }
  const auto x = torch::randn({batch, width});
  const auto y = torch::randint(0, 10, {batch});
  checkpoint::DistributedState state;
  Figures f;
  if (mode == "ckpt-ddp") {
    DistributedDataParallel ddp(net);
    torch::optim::Adam opt(ddp.parameters(), torch::optim::AdamOptions(1e-4));
    checkpoint::add_module(state, *net);
    checkpoint::add_optimizer(state, opt, *net);
    f = measure_saves(a, state, [&](const Hook& before_update) {
      opt.zero_grad();
      torch::nll_loss(ddp.forward(x), y).backward();
      before_update();
      opt.step();
    });
  } else {
    FullyShardedDataParallel fsdp(net);
    torch::optim::Adam opt(fsdp.parameters(), torch::optim::AdamOptions(1e-4));
    checkpoint::add_fsdp(state, fsdp, opt);
    f = measure_saves(a, state, [&](const Hook& before_update) {
      opt.zero_grad();
      torch::nll_loss(fsdp.forward(x), y).backward();
      before_update();
      opt.step();
    });
    report_figures(f);
    int64_t model_bytes = 0;
    for (const auto& item : fsdp.full_state_dict(/*rank0_only=*/false)) model_bytes += item.second.nbytes();
    report_import(a, fsdp, model_bytes);
    destroy_process_group();
    return 0;
  }
  report_figures(f);
  destroy_process_group();
  return 0;
}

int bench_checkpoint(const Args& a) {
  Args rank_args;
  const int layers = a.num("layers", 6), width = a.num("width", 4096), world = a.num("world", 4);
  const std::string dir = a.get("dir", "/tmp/dtrain-bench-checkpoint");
  rank_args.flags = {{"layers", std::to_string(layers)}, {"width", std::to_string(width)},
                     {"batch", a.get("batch", "8")},     {"steps", a.get("steps", "5")},
                     {"saves", a.get("saves", "3")},     {"dir", dir},
                     {"backend", a.get("backend", "auto")},
                     {"background-staging", a.get("background-staging", "0")}};
  // Two keepers, as two hosts' dtrain-run would hold them (--snapshots 0:
  // none, for a state whose copies there would not fit in memory).
  std::optional<checkpoint::SnapshotKeeper> host_a, host_b;
  if (a.num("snapshots", 1) != 0) {
    host_a.emplace();
    host_b.emplace();
    rank_args.flags["keepers"] = host_a->socket_path() + "," + host_b->socket_path();
  }
  const double params = static_cast<double>(layers) * (width * width + width) + width * 10 + 10;
  std::printf("model: %d x Linear(%d, %d) + head, %.1f M parameters, Adam: %.2f GiB of parameters and "
              "moments; %d ranks, checkpoints in %s, medians of %s saves\n",
              layers, width, width, params / 1e6, 12 * params / (1 << 30), world, dir.c_str(),
              rank_args.get("saves", "").c_str());
  std::printf("%-5s %10s %9s %9s %11s %9s %9s %12s %9s %7s %12s %7s %7s %7s %7s %8s\n", "mode", "state_MiB", "step_s",
              "save_s", "1st_stall_s", "stall_s", "write_s", "step_during", "xsave", "xstep", "steps_during",
              "snap_s", "xsnap", "asnap_s", "xasnap", "sent_MiB");
  const std::string modes = a.get("modes", "ddp,fsdp");
  std::string imported;
  auto mib = [](double bytes) {
    char text[32];
    std::snprintf(text, sizeof(text), "%.1f", bytes / (1 << 20));
    return std::string(text);
  };
  for (const std::string mode : {"ddp", "fsdp"}) {
    if (("," + modes + ",").find("," + mode + ",") == std::string::npos) continue;
    capture("rm -rf '" + dir + "' && mkdir -p '" + dir + "'");
    const auto out = run_ranks(world, "ckpt-" + mode, rank_args);
    const double step = field(out, "step"), save = field(out, "save"), stall = field(out, "stall");
    const double during = field(out, "step_during");
    const double snap = field(out, "snapshot"), asnap = field(out, "async_snapshot");
    std::printf("%-5s %10.1f %9.3f %9.3f %11.3f %9.3f %9.3f %12.3f %9.3f %7.3f %12.0f %7.3f %7.3f %7.3f %7.3f %8.1f\n",
                mode.c_str(), field(out, "state_bytes") / (1 << 20), step, save, field(out, "first_stall"), stall,
                field(out, "write"), during, stall / save, during / step, field(out, "steps_during"), snap,
                snap / save, asnap, asnap / save, field(out, "snapshot_sent") / (1 << 20));
    if (mode == "fsdp")
      imported = "import of its weights from safetensors (FSDP " + std::to_string(world) + "): peak RSS " +
                 mib(field(out, "import_peak")) + " MiB per rank over its resting memory, beside its shard of " +
                 mib(field(out, "shard")) + " MiB and the model's " + mib(field(out, "model")) + " MiB; " +
                 std::to_string(static_cast<int>(field(out, "import_s") * 1000)) + " ms\n";
    std::fflush(stdout);
  }
  std::printf("%s", imported.c_str());
  capture("rm -rf '" + dir + "'");
  std::printf("xsave: the stall of async_save over save's time (goal <= 0.15); xstep: a step while the "
              "writer runs over one without (goal <= 1.1); snap_s: a snapshot() in a peer's memory (ranks "
              "0..%d on one keeper, the rest on another, as two hosts), all of it a stall; xsnap: it over "
              "save's time; asnap_s, xasnap: the same for async_snapshot() (its stall: the part read and "
              "encoded); sent_MiB: what each rank sends to the other host's keeper per snapshot\n",
              world / 2 - 1);
  return 0;
}

}  // namespace dtrain::bench
