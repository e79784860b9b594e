// dtrain-bench composed: data parallelism against model parallelism where
// the network is slow. Four ranks on two "hosts" (network namespaces, two
// ranks each: ranks 0 and 1 on the first) joined by a veth shaped to
// --link-rate, one intra-op thread per rank, train a model heavy in
// parameters (--layers x [Linear(--width), ReLU]) with SGD on a global
// batch of 4 x --batch rows:
//
//   ddp   DDP over the 4 ranks
//   fsdp  FSDP over the 4 ranks, each Linear a unit
//   hsdp  FSDP over a 2 x 2 mesh: shards inside a host, replicas across
//   pp    a pipeline of 2 stages across the hosts (1F1B, --microbatches),
//         each stage a DDP over the host's 2 ranks
//
// For each: samples/s over --steps steps after one warm-up, and the bytes
// that crossed the link per timed step (both directions, read from the
// first host's interface counters by rank 0) and over the whole run
// (construction included, where initial values are broadcast); samples/s
// and step bytes also as ratios to DDP's and FSDP's.
//
//   dtrain-bench composed [--link-rate 2gbit] [--width 4096] [--layers 8]
//                         [--batch 32] [--microbatches 4] [--steps 3]
//                         [--backend auto] [--run ddp,fsdp,hsdp,pp]

#include <torch/torch.h>

#include <dirent.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <string>

#include "dtrain/dtrain.h"
#include "ranks.h"

namespace dtrain::bench {
namespace {

namespace pp = pipelining;
using Clock = std::chrono::steady_clock;
using ShardedLinear = FullyShard<torch::nn::LinearImpl>;

// `layers` x [Linear(width, width), ReLU], each Linear an FSDP unit when
// `units`.
torch::nn::Sequential heavy_model(int layers, int width, bool units) {
  torch::manual_seed(0);
  torch::nn::Sequential m;
  for (int i = 0; i < layers; ++i) {
    if (units) m->push_back(std::make_shared<ShardedLinear>(width, width));
    else m->push_back(torch::nn::Linear(width, width));
    m->push_back(torch::nn::ReLU());
  }
  return m;
}

// Bytes through this network namespace's interfaces other than lo (on a
// host of a shaped link: the link's), both directions.
int64_t interface_bytes() {
  int64_t total = 0;
  DIR* dir = ::opendir("/sys/class/net");
  if (dir == nullptr) return 0;
  while (const dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name == "." || name == ".." || name == "lo") continue;
    for (const char* way : {"tx_bytes", "rx_bytes"}) {
      std::ifstream in("/sys/class/net/" + name + "/statistics/" + way);
      int64_t n = 0;
      if (in >> n) total += n;
    }
  }
  ::closedir(dir);
  return total;
}

struct Timed {
  double seconds = 0;
  int64_t bytes = 0;  // through this host's link during the timed steps
};

// Runs `step` once to warm up and `steps` times timed (between barriers).
template <typename Step>
Timed timed(int steps, Step&& step) {
  step();
  barrier();
  const int64_t before = interface_bytes();
  const auto begin = Clock::now();
  for (int i = 0; i < steps; ++i) step();
  barrier();
  return {std::chrono::duration<double>(Clock::now() - begin).count(), interface_bytes() - before};
}

}  // namespace

bool is_composed_mode(const std::string& mode) { return mode.rfind("cp-", 0) == 0; }

int composed_rank_main(const std::string& mode, const Args& a) {
  torch::set_num_threads(1);
  init_process_group(InitOptions().backend(a.get("backend", "auto")));
  const int r = get_rank();
  const int width = a.num("width", 4096), layers = a.num("layers", 8);
  const int batch = a.num("batch", 32), steps = a.num("steps", 3);
  const std::string what = mode.substr(3);
  torch::manual_seed(100 + r);
  auto mse = [](const at::Tensor& o, const at::Tensor& t) { return torch::mse_loss(o, t); };
  Timed run;
  if (what == "ddp" || what == "fsdp" || what == "hsdp") {
    const auto x = torch::randn({batch, width}), y = torch::randn({batch, width});
    auto train = [&](auto& wrapped) {
      torch::optim::SGD opt(wrapped.parameters(), 1e-4);
      return timed(steps, [&] {
        opt.zero_grad();
        mse(wrapped.forward(x), y).backward();
        opt.step();
      });
    };
    if (what == "ddp") {
      DistributedDataParallel ddp(heavy_model(layers, width, false).ptr());
      run = train(ddp);
    } else {
      auto options = FSDPOptions();
      if (what == "hsdp") options.mesh(init_device_mesh({2, 2}, {"replicate", "shard"}));
      FullyShardedDataParallel fsdp(heavy_model(layers, width, true).ptr(), options);
      run = train(fsdp);
    }
  } else {
    // Two pipelines of 2 x batch rows each: stage = host, replica = rank in the host.
    auto mesh = init_device_mesh({2, 2}, {"pp", "dp"});
    const int stage = mesh.get_local_rank("pp");
    auto piece = pp::split_sequential(heavy_model(layers, width, false), 2)[stage];
    auto ddp = std::make_shared<DistributedDataParallel<torch::nn::SequentialImpl>>(
        piece.ptr(), DDPOptions().process_group(mesh.get_group("dp")));
    pp::Schedule1F1B schedule(
        pp::PipelineStage(ddp, stage, 2, pp::PipelineStageOptions().group(mesh.get_group("pp"))),
        a.num("microbatches", 4), mse);
    const auto x = torch::randn({2 * batch, width}), y = torch::randn({2 * batch, width});
    torch::optim::SGD opt(ddp->parameters(), 1e-4);
    run = timed(steps, [&] {
      opt.zero_grad();
      if (stage == 0) schedule.step(x);
      else schedule.step(y, nullptr);
      opt.step();
    });
  }
  if (r == 0)
    std::printf("result samples_per_s=%.3f step_ms=%.1f step_link_bytes=%lld\n",
                steps * 4.0 * batch / run.seconds, 1000 * run.seconds / steps,
                static_cast<long long>(run.bytes / steps));
  destroy_process_group();
  return 0;
}

int bench_composed(const Args& a) {
  const std::string rate = a.get("link-rate", "2gbit");
  Args rank_args;
  for (const char* k : {"width", "layers", "batch", "microbatches", "steps", "backend"})
    if (a.flags.count(k)) rank_args.flags[k] = a.get(k, "");
  ShapedLink link(rate, /*per_host=*/2);
  std::printf("composed: 4 ranks on 2 hosts (2 each) joined by a %s link, %s x Linear(%s) + ReLU, "
              "global batch 4 x %s, SGD, %s timed steps\n",
              rate.c_str(), a.get("layers", "8").c_str(), a.get("width", "4096").c_str(),
              a.get("batch", "32").c_str(), a.get("steps", "3").c_str());
  std::printf("%-6s %10s %10s %13s %11s %9s %9s %13s\n", "run", "samples/s", "step_ms",
              "step_link_MB", "run_link_MB", "xDDP", "xFSDP", "bytes_xFSDP");
  std::map<std::string, std::pair<double, double>> got;  // samples/s, link bytes a step
  const std::string parts = a.get("run", "ddp,fsdp,hsdp,pp");
  for (const char* what : {"ddp", "fsdp", "hsdp", "pp"}) {
    if (parts.find(what) == std::string::npos) continue;
    const int64_t before = link.bytes();
    const auto out = run_ranks(4, std::string("cp-") + what, rank_args, &link);
    const double run_bytes = static_cast<double>(link.bytes() - before);
    const double speed = field(out, "samples_per_s"), step_bytes = field(out, "step_link_bytes");
    got[what] = {speed, step_bytes};
    auto ratio = [&](const char* base, bool bytes) {
      if (!got.count(base)) return 0.0;
      return bytes ? step_bytes / got[base].second : speed / got[base].first;
    };
    std::printf("%-6s %10.2f %10.1f %13.1f %11.1f %9.3f %9.3f %13.3f\n", what, speed,
                field(out, "step_ms"), step_bytes / 1e6, run_bytes / 1e6, ratio("ddp", false),
                ratio("fsdp", false), ratio("fsdp", true));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace dtrain::bench
