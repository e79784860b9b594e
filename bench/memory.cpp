// dtrain-bench memory: what one rank holds, and how fast it trains, under
// DDP, ZeroRedundancyOptimizer (ZeRO-1), ZeRO-2 (DDP's shard_gradients
// with ZeroRedundancyOptimizer over it), FSDP without resharding after
// forward (PyTorch's SHARD_GRAD_OP, its ZeRO-2 counterpart) and FSDP
// (ZeRO-3): a wide MLP (--layers square layers of --width, each an FSDP
// unit) trained with Adam, under DTRAIN_CPU_MEMORY=--cpu-memory (system by
// default: malloc as glibc has it; cache: dtrain's default, which keeps
// what malloc frees, FSDP's buffers excepted), side by side at each world
// size of --worlds, every column also as a ratio to DDP's.
//
//   logical   bytes of the distinct tensors a rank keeps between steps:
//             parameters, gradients, optimizer state, DDP's buckets
//   peak_rss  the largest VmHWM over the ranks, model construction
//             included (FSDP's under a ShardedConstruction: one layer in
//             full at a time; the other modes build the whole model)
//   peak_vm   the largest VmPeak (address space, what prlimit --as limits)
//   gathered  FSDP: the most full-parameter memory held at once in a step
//
// --limit-mb M also runs DDP and FSDP at the first world size with each
// rank's address space limited to M MiB (prlimit --as) and prints what
// each says: DDP's out-of-memory error, FSDP's throughput.

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/dtrain.h"
#include "models.h"
#include "ranks.h"

namespace dtrain::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Mode {
  const char* name;   // the rank mode
  const char* label;  // in the table
};
const std::vector<Mode> kModes = {{"mem-ddp", "DDP"},
                                  {"mem-zero1", "ZeRO-1"},
                                  {"mem-zero2", "ZeRO-2"},
                                  {"mem-gradop", "FSDP-gradop"},
                                  {"mem-fsdp", "FSDP"}};

// Bytes of the distinct storages behind the tensors added (views of one
// buffer count once; freed storages count zero).
struct Tally {
  std::set<const void*> seen;
  int64_t bytes = 0;
  void add(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    if (seen.insert(t.storage().unsafeGetStorageImpl()).second)
      bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  void add_optimizer(torch::optim::Optimizer& opt) {
    for (auto& group : opt.param_groups())
      for (auto& p : group.params()) add(p), add(p.grad());
    for (auto& item : opt.state())
      if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(item.second.get()))
        add(adam->exp_avg()), add(adam->exp_avg_sq()), add(adam->max_exp_avg_sq());
  }
};

std::unique_ptr<torch::optim::Optimizer> adam(std::vector<torch::Tensor> params) {
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-4));
}

}  // namespace

bool is_memory_mode(const std::string& mode) { return mode.rfind("mem-", 0) == 0; }

int memory_rank_main(const std::string& mode, const Args& a) {
  torch::set_num_threads(1);
  init_process_group(InitOptions().backend(a.get("backend", "auto")));
  const int world = get_world_size(), steps = a.num("steps", 3), batch = a.num("batch", 8);
  const int width = a.num("width", 4096);
  torch::manual_seed(0);
  // FSDP builds its units sharded (one layer in full at a time); the
  // others build the whole model.
  std::shared_ptr<WideMlpImpl> net;
  {
    std::optional<ShardedConstruction> sharded;
    if (mode == "mem-fsdp" || mode == "mem-gradop") sharded.emplace();
    net = std::make_shared<WideMlpImpl>(a.num("layers", 6), width);
  }
  const auto x = torch::randn({batch, width});
  const auto y = torch::randint(0, 10, {batch});
  Tally tally;
  int64_t gathered = 0;
  double seconds = 0;
  auto run = [&](auto&& forward, torch::optim::Optimizer& opt) {
    auto step = [&] {
      opt.zero_grad();
      torch::nll_loss(forward(x), y).backward();
      opt.step();
    };
    step();  // warm-up
    barrier();
    const auto t0 = Clock::now();
    for (int i = 0; i < steps; ++i) step();
    barrier();
    seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  };
  if (mode == "mem-ddp" || mode == "mem-zero1") {
    const bool zero = mode == "mem-zero1";
    // ZeRO-1 with gradients as views of DDP's buckets, as PyTorch recommends.
    DistributedDataParallel ddp(net, DDPOptions().gradient_as_bucket_view(zero));
    auto forward = [&](const torch::Tensor& in) { return ddp.forward(in); };
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (zero)
      opt = std::make_unique<ZeroRedundancyOptimizer>(ddp.parameters(), adam);
    else
      opt = adam(ddp.parameters());
    run(forward, *opt);
    for (const auto& p : net->parameters()) tally.add(p), tally.add(p.grad());
    if (!zero)
      for (auto b : ddp.stats().bucket_bytes) tally.bytes += b;
    tally.add_optimizer(zero ? static_cast<ZeroRedundancyOptimizer&>(*opt).local_optimizer() : *opt);
  } else if (mode == "mem-zero2") {
    // Buckets reduce-scattered and freed in backward: between steps a rank
    // keeps the parameters, its gradient shares and their Adam state.
    DistributedDataParallel ddp(net, DDPOptions().shard_gradients(true));
    ZeroRedundancyOptimizer opt(ddp, adam);
    run([&](const torch::Tensor& in) { return ddp.forward(in); }, opt);
    for (const auto& p : net->parameters()) tally.add(p), tally.add(p.grad());
    tally.add_optimizer(opt.local_optimizer());
  } else {
    FullyShardedDataParallel fsdp(net, FSDPOptions().reshard_after_forward(mode == "mem-fsdp"));
    auto opt = adam(fsdp.parameters());
    run([&](const torch::Tensor& in) { return fsdp.forward(in); }, *opt);
    for (const auto& p : net->parameters()) tally.add(p), tally.add(p.grad());
    tally.add_optimizer(*opt);
    gathered = fsdp.stats().peak_gathered_bytes;
  }
  auto report = at::tensor(
      {tally.bytes, vm_status_bytes("VmHWM:"), vm_status_bytes("VmPeak:"), gathered}, at::kLong);
  all_reduce(report, AllReduceOptions().op(ReduceOp::MAX));
  auto item = [&](int i) { return static_cast<long long>(report[i].item<int64_t>()); };
  if (get_rank() == 0)
    std::printf("result logical=%lld peak_rss=%lld peak_vm=%lld gathered=%lld samples_per_s=%.2f\n",
                item(0), item(1), item(2), item(3), steps * batch * world / seconds);
  destroy_process_group();
  return 0;
}

namespace {

std::vector<int> parse_worlds(const std::string& text) {
  std::vector<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stoi(item));
  return out;
}

// Rank 0's error line, or "".
std::string error_of(const std::string& output) {
  std::stringstream in(output);
  std::string line, last;
  while (std::getline(in, line))
    if (line.find("rror") != std::string::npos) return line.substr(0, 220);
  return "";
}

void limited_runs(const Args& rank_args, int world, int limit_mb) {
  const std::string env = "DTRAIN_CPU_MEMORY=system prlimit --as=" +
                          std::to_string(static_cast<int64_t>(limit_mb) << 20);
  std::printf("\nwith each rank's address space limited to %d MiB (prlimit --as), %d ranks:\n",
              limit_mb, world);
  for (const auto& mode : {kModes.front(), kModes.back()}) {
    const auto out = run_ranks(world, mode.name, rank_args, nullptr, env + " 2>&1");
    const double rate = out.find("samples_per_s=") != std::string::npos ? field(out, "samples_per_s") : 0;
    if (rate > 0)
      std::printf("  %-12s trains: %.2f samples/s\n", mode.label, rate);
    else
      std::printf("  %-12s fails: %s\n", mode.label, error_of(out).c_str());
  }
}

}  // namespace

int bench_memory(const Args& a) {
  Args rank_args;
  const int layers = a.num("layers", 6), width = a.num("width", 4096);
  rank_args.flags = {{"layers", std::to_string(layers)}, {"width", std::to_string(width)},
                     {"batch", a.get("batch", "8")}, {"steps", a.get("steps", "3")},
                     {"backend", a.get("backend", "auto")}};
  const double params = static_cast<double>(layers) * (width * width + width) + width * 10 + 10;
  const double p_bytes = 4 * params;
  std::printf("model: %d x Linear(%d, %d) + head, %.1f M parameters, P = %.0f MiB (fp32), Adam, "
              "batch %s/rank, %s steps, backend %s, DTRAIN_CPU_MEMORY=%s\n",
              layers, width, width, params / 1e6, p_bytes / (1 << 20), rank_args.get("batch", "").c_str(),
              rank_args.get("steps", "").c_str(), rank_args.get("backend", "").c_str(),
              a.get("cpu-memory", "system").c_str());
  std::printf("%-5s %-12s %11s %7s %6s %12s %7s %11s %12s %10s %7s\n", "world", "mode",
              "logical_MiB", "xDDP", "xP", "peak_rss_MiB", "xDDP", "peak_vm_MiB", "gathered_MiB",
              "samples/s", "xDDP");
  const auto worlds = parse_worlds(a.get("worlds", "2,4"));
  const std::string cpu_memory = a.get("cpu-memory", "system");
  for (int world : worlds) {
    double base_logical = 0, base_rss = 0, base_rate = 0;
    for (const auto& mode : kModes) {
      const auto out = run_ranks(world, mode.name, rank_args, nullptr, "DTRAIN_CPU_MEMORY=" + cpu_memory);
      const double logical = field(out, "logical"), rss = field(out, "peak_rss");
      const double rate = field(out, "samples_per_s"), gathered = field(out, "gathered");
      const double vm = field(out, "peak_vm");
      if (base_logical == 0) base_logical = logical, base_rss = rss, base_rate = rate;
      std::printf("%-5d %-12s %11.1f %7.3f %6.2f %12.1f %7.3f %11.1f %12.1f %10.2f %7.3f\n", world,
                  mode.label, logical / (1 << 20), logical / base_logical, logical / p_bytes,
                  rss / (1 << 20), rss / base_rss, vm / (1 << 20), gathered / (1 << 20), rate,
                  rate / base_rate);
      std::fflush(stdout);
    }
    std::printf("      ideal xP at N=%d: DDP >= 4, ZeRO-1 %.2f, ZeRO-2 %.2f, FSDP %.2f (+ one unit)\n",
                world, 2 + 2.0 / world, 1 + 3.0 / world, 4.0 / world);
  }
  const int limit = a.num("limit-mb", 0);
  if (limit > 0) limited_runs(rank_args, worlds.front(), limit);
  return 0;
}

}  // namespace dtrain::bench
