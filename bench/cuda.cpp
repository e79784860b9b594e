// dtrain-bench cuda: DDP on CUDA tensors beside PyTorch's DDP, same model,
// same batch, interleaved runs, medians reported.
//
//   dtrain-bench cuda [--world 1] [--layers 8] [--width 4096] [--batch 256] [--steps 50]
//                     [--runs 3] [--backend nccl] [--baseline bench/baselines/cuda_ddp.py]
//
// World 1 (the GPU issue's item 3): the cost of DDP over the plain model on
// one GPU through nccl, for dtrain and for PyTorch (nccl), as overheads in
// percent. World 2 on one GPU (item 4): ranks sharing the GPU, dtrain's
// auto (CUDA tensors staged through shared memory) beside PyTorch with gloo
// on CUDA tensors, in samples/s. Ranks are child processes of this binary.

#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "dtrain/dtrain.h"
#include "bench_util.h"
#include "models.h"
#include "ranks.h"

namespace dtrain::bench {
namespace {

using Clock = std::chrono::steady_clock;

template <typename Step>
double time_cuda_steps(int steps, Step&& step) {
  for (int i = 0; i < 5; ++i) step();  // warm-up: cuBLAS handles, DDP's buckets
  torch::cuda::synchronize();
  dtrain::barrier();
  const auto t0 = Clock::now();
  for (int i = 0; i < steps; ++i) step();
  torch::cuda::synchronize();
  dtrain::barrier();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

bool is_cuda_mode(const std::string& mode) { return mode == "cuda-plain" || mode == "cuda-ddp"; }

// One rank: the MLP on this rank's GPU (LOCAL_RANK % device count), plain
// or under DDP, SGD; prints step_ms and samples/s of the whole job.
int cuda_rank_main(const std::string& mode, const Args& a) {
  dtrain::init_process_group(dtrain::InitOptions().backend(a.get("backend", "nccl")));
  const int world = dtrain::get_world_size();
  const int steps = a.num("steps", 50), batch = a.num("batch", 256), width = a.num("width", 4096);
  const int gpus = static_cast<int>(torch::cuda::device_count());
  if (gpus == 0) throw std::runtime_error("dtrain-bench cuda: no GPU is visible");
  const torch::Device device(torch::kCUDA, static_cast<c10::DeviceIndex>(dtrain::get_rank() % gpus));
  torch::manual_seed(0);
  auto net = DeepMlp(a.num("layers", 8), width);
  net->to(device);
  auto x = torch::randn({batch, width}, device);
  auto target = torch::randn({batch, width}, device);
  double seconds = 0;
  if (mode == "cuda-ddp") {
    dtrain::DistributedDataParallel ddp(net);
    torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(1e-4));
    seconds = time_cuda_steps(steps, [&] {
      opt.zero_grad();
      torch::mse_loss(ddp.forward(x), target).backward();
      opt.step();
    });
  } else {
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(1e-4));
    seconds = time_cuda_steps(steps, [&] {
      opt.zero_grad();
      torch::mse_loss(net->forward(x), target).backward();
      opt.step();
    });
  }
  if (dtrain::get_rank() == 0)
    std::printf("result step_ms=%.3f samples_per_s=%.1f\n", seconds / steps * 1e3,
                steps * batch * world / seconds);
  dtrain::destroy_process_group();
  return 0;
}

int bench_cuda(const Args& a) {
  const int world = a.num("world", 1), runs = a.num("runs", 3);
  const std::string backend = a.get("backend", world == 1 ? "nccl" : "auto");
  const std::string baseline = a.get("baseline", "bench/baselines/cuda_ddp.py");
  Args rank_args;
  for (const char* k : {"layers", "width", "batch", "steps"})
    if (a.flags.count(k)) rank_args.flags[k] = a.flags.at(k);
  rank_args.flags["backend"] = backend;
  std::string py_args;
  for (const auto& [k, dflt] : std::vector<std::pair<std::string, std::string>>{
           {"layers", "8"}, {"width", "4096"}, {"batch", "256"}, {"steps", "50"}})
    py_args += " --" + k + " " + a.get(k, dflt);
  py_args += " --world " + std::to_string(world) + " --backend " + (world == 1 ? "nccl" : "gloo");
  std::printf("%-4s %12s %12s %12s %12s %10s %10s %10s\n", "run", "dtrain_ms", "dtrain_ddp_ms",
              "pytorch_ms", "pytorch_ddp_ms", "dtrain_ovh", "torch_ovh", "ddp_ratio");
  std::vector<double> d_ovh, p_ovh, ratio, d_sps, p_sps;
  for (int r = 0; r < runs; ++r) {
    const auto plain = run_ranks(world, "cuda-plain", rank_args);
    const auto ddp = run_ranks(world, "cuda-ddp", rank_args);
    const auto py = capture(python_of(a) + " " + baseline + py_args + " 2>&1");
    const double dp = field(plain, "step_ms"), dd = field(ddp, "step_ms");
    const double pp = field(py, "plain_step_ms"), pd = field(py, "ddp_step_ms");
    d_ovh.push_back(dd / dp - 1), p_ovh.push_back(pd / pp - 1), ratio.push_back(pd / dd);
    d_sps.push_back(field(ddp, "samples_per_s")), p_sps.push_back(field(py, "ddp_samples_per_s"));
    std::printf("%-4d %12.3f %12.3f %12.3f %12.3f %9.1f%% %9.1f%% %10.3f\n", r, dp, dd, pp, pd,
                100 * d_ovh.back(), 100 * p_ovh.back(), ratio.back());
    std::fflush(stdout);
  }
  std::printf("median: world %d on %s, dtrain DDP overhead %.1f%%, PyTorch DDP overhead %.1f%%, "
              "DDP samples/s dtrain %.1f PyTorch %.1f, ratio (PyTorch DDP step / dtrain's) %.3f\n",
              world, backend.c_str(), 100 * median(d_ovh), 100 * median(p_ovh), median(d_sps),
              median(p_sps), median(ratio));
  return 0;
}

}  // namespace dtrain::bench
