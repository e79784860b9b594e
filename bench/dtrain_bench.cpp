// dtrain-bench: training benchmarks, always side by side with a baseline
// run in the same invocation, several interleaved runs, medians reported.
//
//   dtrain-bench ddp      [--world 2] [--steps 30] [--batch 64] [--runs 3] [--baseline PATH]
//       MNIST convnet DDP throughput vs PyTorch's Python DDP (PATH defaults to
//       ../shared/baselines/py_ddp_train.py), 2-rank scaling vs one process
//       (and, as its ceiling, 2 independent processes vs one), dtrain's
//       default backend (auto: shm here) vs tcp, DTRAIN_CPU_MEMORY=cache
//       (the default) vs system, and the flight recorder on (the default) vs
//       off (DTRAIN_TRACE_BUFFER_SIZE=0).
//   dtrain-bench overlap  [--steps 10] [--batch 32] [--runs 3] [--layers 8] [--width 1024]
//                         [--backend auto|shm|tcp]
//       Deep MLP step time: compute alone, compute then communication, and DDP
//       (overlapped); prints the share of communication hidden behind backward.
//       --link-rate RATE (e.g. 2gbit; needs root): the two ranks run on two
//       network namespaces joined by a veth link shaped to RATE.
//       --pin-compute 1: both ranks compute on core 0 and communicate on the
//       other, as a GPU job computes on the device while the host communicates.
//   dtrain-bench dp       [--replicas 2] [--steps 20] [--batch 128] [--runs 5]
//       One process: MNIST convnet training with DataParallel on --replicas CPU
//       replicas vs one module with as many intra-op threads (and with one).
//   dtrain-bench syncbn   [--world 2] [--steps 20] [--batch 16] [--runs 3] [--blocks 2] [--width 32]
//       Step time of a small ResNet-style convnet (3x32x32 images) under DDP
//       with SyncBatchNorm2d vs with plain BatchNorm2d, interleaved runs:
//       SyncBatchNorm's overhead.
//   dtrain-bench composed [--link-rate 2gbit] [--width 4096] [--layers 8] ...
//       DDP, FSDP, HSDP and a pipeline of DDP stages on 4 ranks over two
//       hosts joined by a shaped link: samples/s and the bytes that cross
//       the link; see composed.cpp.
//   dtrain-bench slow-links [--link-rate 100mbit] [--sync-every 32] [--fragments 4] ...
//       DDP, DiLoCo and Streaming DiLoCo on 2 hosts joined by a shaped link:
//       samples/s, bytes per sync, and the evaluation loss at equal samples;
//       see slow_links.cpp.
//   dtrain-bench pipeline [--ranks 2] [--microbatches 8] [--batch 512] ...
//       The pipeline schedules' bubble beside its theory, and 1F1B's peak
//       memory against GPipe's; see pipeline.cpp.
//   dtrain-bench tp       [--width 512] [--blocks 8] [--seq 2048] [--runs 3] [--run memory,ac,speed]
//       Tensor parallelism's per-rank parameter + gradient + Adam bytes at
//       TP 2 and 4 against one process, and activation checkpointing's
//       activation peak and step time against none; the Llama model's tokens/s at
//       TP 2 against one process on 2 threads; tensor_parallel.cpp.
//   dtrain-bench ep       [--experts 8] [--dim 256] [--hidden 512] [--tokens 2048] [--run memory,speed]
//       Expert parallelism's per-rank expert parameter + gradient + Adam
//       bytes at EP 2 and 4 against one process, and an MoE layer's tokens/s
//       at EP 2 against one process on 2 threads; expert_parallel.cpp.
//   dtrain-bench checkpoint [--world 4] [--layers 6] [--width 4096] [--saves 3] [--dir D]
//                           [--modes ddp,fsdp] [--snapshots 1] [--background-staging 0]
//       save() against async_save() on DDP and FSDP with Adam: the training
//       stall of each, and a step's time while the background writer runs;
//       snapshot() and async_snapshot() into two keepers (--snapshots 0:
//       not measured); see checkpoint.cpp.
//   dtrain-bench memory   [--worlds 2,4] [--layers 6] [--width 4096] [--batch 8] [--steps 3]
//       Per-rank memory and speed of DDP, ZeroRedundancyOptimizer and FSDP
//       training a wide MLP with Adam; see memory.cpp.
//   dtrain-bench cuda     [--world 1] [--layers 8] [--width 4096] [--batch 256] [--steps 50]
//       DDP on CUDA tensors beside PyTorch's DDP: its overhead over the plain
//       model at world 1 (nccl), samples/s of ranks sharing a GPU; cuda.cpp.
//   dtrain-bench ft       [--replicas 2] [--ranks 2] [--steps 60] [--batch 64] [--runs 3]
//       FT-DDP (replica groups around a lighthouse) against plain DDP over the
//       same ranks, nothing failing: fault tolerance's step-time cost; ft.cpp.
//   dtrain-bench collectives [--backend auto] [--op all_reduce] ... (run under dtrain-run)
//       nccl-tests-style sweep of one collective; see collectives.cpp.
//
// Every Python baseline runs with --python PATH (default: the first of
// python3 on PATH and /usr/bin/python3 that imports torch).
//
// Ranks are child processes of this binary (`dtrain-bench rank ...`) that
// rendezvous over env:// on 127.0.0.1, one intra-op thread each.

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <sched.h>
#include <unistd.h>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/dtrain.h"
#include "bench_util.h"
#include "collectives.h"
#include "models.h"
#include "ranks.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace dtrain::bench;

// ---- inside a rank ---------------------------------------------------------

template <typename Step>
double time_steps(int steps, Step&& step) {
  for (int i = 0; i < 5; ++i) step();  // warm-up (and DDP's bucket rebuild)
  dtrain::barrier();
  auto t0 = Clock::now();
  for (int i = 0; i < steps; ++i) step();
  dtrain::barrier();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int rank_main(const std::string& mode, const Args& a) {
  torch::set_num_threads(1);
  dtrain::init_process_group(dtrain::InitOptions().backend(a.get("backend", "auto")));
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  const int steps = a.num("steps", 30), batch = a.num("batch", 64);
  torch::manual_seed(0);
  double seconds = 0, hidden = 0;
  if (mode == "ddp" || mode == "local" || mode == "ddp-nocomm") {
    auto net = dtrain::bench::MnistNet();
    auto x = torch::randn({batch, 1, 28, 28});
    auto y = torch::randint(0, 10, {batch});
    if (mode != "local") {
      dtrain::DistributedDataParallel ddp(net);
      if (mode == "ddp-nocomm") ddp.register_comm_hook([](dtrain::ProcessGroup&, dtrain::GradBucket&) {});
      torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
      seconds = time_steps(steps, [&] {
        opt.zero_grad();
        torch::nll_loss(ddp.forward(x), y).backward();
        opt.step();
      });
    } else {
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
      seconds = time_steps(steps, [&] {
        opt.zero_grad();
        torch::nll_loss(net->forward(x), y).backward();
        opt.step();
      });
    }
  } else if (mode == "syncbn" || mode == "plainbn") {
    auto net = dtrain::bench::ResNet(a.num("blocks", 2), a.num("width", 32), mode == "syncbn");
    auto x = torch::randn({batch, 3, 32, 32});
    auto y = torch::randint(0, 10, {batch});
    dtrain::DistributedDataParallel ddp(net.ptr());
    torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    seconds = time_steps(steps, [&] {
      opt.zero_grad();
      torch::nll_loss(ddp.forward(x), y).backward();
      opt.step();
    });
  } else {
    auto net = dtrain::bench::DeepMlp(a.num("layers", 8), a.num("width", 1024));
    auto x = torch::randn({batch, a.num("width", 1024)});
    auto target = torch::randn({batch, a.num("width", 1024)});
    dtrain::DistributedDataParallel ddp(
        net, dtrain::DDPOptions().bucket_cap_mb(std::stod(a.get("bucket_cap_mb", "25"))));
    if (a.get("pin-compute", "0") == "1") {
      // Only this (the compute) thread moves to core 0; the communication
      // threads, already running, keep the other core — like a GPU that
      // computes while the CPU and the network communicate.
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(0, &one);
      sched_setaffinity(0, sizeof(one), &one);
    }
    torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.001));
    std::vector<double> fractions;
    seconds = time_steps(steps, [&] {
      opt.zero_grad();
      if (mode == "overlap-ddp") {
        torch::mse_loss(ddp.forward(x), target).backward();
        fractions.push_back(ddp.stats().hidden_fraction);
      } else {
        {
          auto guard = ddp.no_sync();
          torch::mse_loss(ddp.forward(x), target).backward();
        }
        if (mode == "overlap-sequential") {
          // The same bytes, all-reduced after backward instead of during it.
          std::vector<torch::Tensor> grads;
          for (auto& p : ddp.parameters()) grads.push_back(p.grad().view({-1}));
          auto flat = torch::cat(grads);
          dtrain::all_reduce(flat, dtrain::AllReduceOptions().op(dtrain::ReduceOp::AVG));
        }
      }
      opt.step();
    });
    hidden = median(fractions);
  }
  if (rank == 0) {
    std::printf("result step_ms=%.3f samples_per_s=%.1f hidden_stat=%.3f\n", seconds / steps * 1e3,
                steps * batch * world / seconds, hidden);
  }
  dtrain::destroy_process_group();
  return 0;
}

// ---- the benchmarks ----------------------------------------------------------

int bench_ddp(const Args& a) {
  const int world = a.num("world", 2), runs = a.num("runs", 3);
  const int steps = a.num("steps", 30), batch = a.num("batch", 64);
  const std::string baseline = a.get("baseline", "../shared/baselines/py_ddp_train.py");  // from the repository root
  Args rank_args;
  rank_args.flags = {{"steps", std::to_string(steps)}, {"batch", std::to_string(batch)}};
  auto with_backend = [&](const std::string& backend) {
    Args b = rank_args;
    b.flags["backend"] = backend;
    return b;
  };
  std::vector<double> ratio, scaling, ceiling, vs_tcp, memory, recorder;
  std::printf("%-4s %13s %13s %13s %13s %13s %13s %13s %7s %7s %7s %9s %9s %9s\n", "run",
              "pytorch_ddp/s", "dtrain_auto/s", "dtrain_tcp/s", "auto_sysmem/s", "auto_norec/s",
              "dtrain_1proc/s", "Nx_indep/s", "ratio", "scaling", "ceiling", "auto/tcp",
              "cache/sys", "rec/norec");
  for (int r = 0; r < runs; ++r) {
    const double p = field(capture(python_of(a) + " " + baseline + " " + std::to_string(world) +
                                   " " + std::to_string(steps) + " " + std::to_string(batch) +
                                   " 2>/dev/null"),
                           "samples_per_s");
    const double d = field(run_ranks(world, "ddp", with_backend("auto")), "samples_per_s");
    const double g = field(run_ranks(world, "ddp", with_backend("tcp")), "samples_per_s");
    // dtrain with malloc left as glibc configures it: what DTRAIN_CPU_MEMORY's
    // cache (the default) contributes to the ratio.
    const double m = field(run_ranks(world, "ddp", with_backend("auto"), nullptr,
                                     "DTRAIN_CPU_MEMORY=system"),
                           "samples_per_s");
    // The flight recorder off: what recording every collective costs.
    const double f = field(run_ranks(world, "ddp", with_backend("auto"), nullptr,
                                     "DTRAIN_TRACE_BUFFER_SIZE=0"),
                           "samples_per_s");
    const double s = field(run_ranks(1, "local", rank_args), "samples_per_s");
    // `world` processes training without DDP at the same time: what the
    // machine gives N busy cores (shared caches, memory bandwidth, other
    // tenants), the ceiling of any scaling efficiency here.
    const double n = field(run_ranks(world, "local", rank_args), "samples_per_s");
    ratio.push_back(d / p), scaling.push_back(d / (world * s)), ceiling.push_back(n / (world * s));
    vs_tcp.push_back(d / g), memory.push_back(d / m), recorder.push_back(d / f);
    std::printf("%-4d %13.1f %13.1f %13.1f %13.1f %13.1f %13.1f %13.1f %7.3f %7.3f %7.3f %9.3f "
                "%9.3f %9.3f\n",
                r, p, d, g, m, f, s, n, d / p, d / (world * s), n / (world * s), d / g, d / m,
                d / f);
    std::fflush(stdout);
  }
  std::printf("median: dtrain (auto: shm on one machine) / pytorch DDP samples/s = %.3f, %d-rank "
              "scaling efficiency = %.3f (%d independent processes without DDP reach %.3f), "
              "dtrain auto / dtrain tcp = %.3f, DTRAIN_CPU_MEMORY cache / system = %.3f, flight "
              "recorder on / off = %.3f (world %d, batch %d/rank, %d steps, 1 thread/rank)\n",
              median(ratio), world, median(scaling), world, median(ceiling), median(vs_tcp),
              median(memory), median(recorder), world, batch, steps);
  return 0;
}

int bench_overlap(const Args& a) {
  const int runs = a.num("runs", 5);
  Args rank_args;
  rank_args.flags = {{"steps", a.get("steps", "10")}, {"batch", a.get("batch", "8")},
                     {"layers", a.get("layers", "8")}, {"width", a.get("width", "1024")},
                     {"bucket_cap_mb", a.get("bucket_cap_mb", "25")},
                     {"pin-compute", a.get("pin-compute", "0")},
                     {"backend", a.get("backend", "auto")}};
  std::unique_ptr<ShapedLink> link;
  const std::string rate = a.get("link-rate", "");
  if (!rate.empty()) link = std::make_unique<ShapedLink>(rate);
  std::vector<double> compute, sequential, overlapped, stat;
  std::printf("%-4s %12s %14s %12s %12s\n", "run", "compute_ms", "sequential_ms", "ddp_ms",
              "hidden_stat");
  for (int r = 0; r < runs; ++r) {
    compute.push_back(field(run_ranks(2, "overlap-compute", rank_args, link.get()), "step_ms"));
    sequential.push_back(field(run_ranks(2, "overlap-sequential", rank_args, link.get()), "step_ms"));
    auto out = run_ranks(2, "overlap-ddp", rank_args, link.get());
    overlapped.push_back(field(out, "step_ms"));
    stat.push_back(field(out, "hidden_stat"));
    std::printf("%-4d %12.1f %14.1f %12.1f %12.3f\n", r, compute.back(), sequential.back(),
                overlapped.back(), stat.back());
    std::fflush(stdout);
  }
  // From the medians: the communication that sequential execution adds,
  // and how much of it DDP's overlap removes.
  const double c = median(compute), s = median(sequential), o = median(overlapped);
  const double hidden = s > c ? (s - o) / (s - c) : 0;
  std::printf("median step: compute %.1f ms, compute+communication %.1f ms, DDP %.1f ms -> %.0f%% "
              "of communication hidden (DDP's own stat: %.0f%%; 2 ranks, %s layers of %s, batch "
              "%s, bucket_cap_mb %s, %s)\n",
              c, s, o, 100 * hidden, 100 * median(stat), rank_args.get("layers", "").c_str(),
              rank_args.get("width", "").c_str(), rank_args.get("batch", "").c_str(),
              rank_args.get("bucket_cap_mb", "").c_str(),
              (rate.empty() ? "one machine, backend " + rank_args.get("backend", "")
                            : "two netns hosts, link shaped to " + rate).c_str());
  return 0;
}

int bench_syncbn(const Args& a) {
  const int world = a.num("world", 2), runs = a.num("runs", 3);
  Args rank_args;
  rank_args.flags = {{"steps", a.get("steps", "20")}, {"batch", a.get("batch", "16")},
                     {"blocks", a.get("blocks", "2")}, {"width", a.get("width", "32")},
                     {"backend", a.get("backend", "auto")}};
  std::vector<double> plain, sync, overhead;
  std::printf("%-4s %14s %14s %10s\n", "run", "batchnorm_ms", "syncbn_ms", "overhead");
  for (int r = 0; r < runs; ++r) {
    // Alternating order, so drift hits both alike.
    double p = 0, s = 0;
    for (int k = 0; k < 2; ++k) {
      if ((r + k) % 2 == 0) p = field(run_ranks(world, "plainbn", rank_args), "step_ms");
      else s = field(run_ranks(world, "syncbn", rank_args), "step_ms");
    }
    plain.push_back(p), sync.push_back(s), overhead.push_back(s / p - 1);
    std::printf("%-4d %14.2f %14.2f %9.1f%%\n", r, p, s, 100 * (s / p - 1));
    std::fflush(stdout);
  }
  std::printf("median step: BatchNorm2d %.2f ms, SyncBatchNorm2d %.2f ms -> SyncBatchNorm overhead "
              "%.1f%% (DDP, %d ranks, backend %s, ResNet-style convnet of %s blocks x %s channels, "
              "batch %s/rank of 3x32x32)\n",
              median(plain), median(sync), 100 * median(overhead), world,
              rank_args.get("backend", "").c_str(), rank_args.get("blocks", "").c_str(),
              rank_args.get("width", "").c_str(), rank_args.get("batch", "").c_str());
  return 0;
}

// SGD steps per second x batch, after 3 warm-up steps.
template <typename Forward>
double train_samples_per_s(torch::nn::Module& net, Forward&& forward, const torch::Tensor& x,
                           const torch::Tensor& y, int steps) {
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto step = [&] {
    opt.zero_grad();
    torch::nll_loss(forward(x), y).backward();
    opt.step();
  };
  for (int i = 0; i < 3; ++i) step();
  const auto t0 = Clock::now();
  for (int i = 0; i < steps; ++i) step();
  return steps * x.size(0) / std::chrono::duration<double>(Clock::now() - t0).count();
}

int bench_dp(const Args& a) {
  const int replicas = a.num("replicas", 2), runs = a.num("runs", 5);
  const int steps = a.num("steps", 20), batch = a.num("batch", 128);
  torch::manual_seed(0);
  const auto x = torch::randn({batch, 1, 28, 28});
  const auto y = torch::randint(0, 10, {batch});
  auto single = dtrain::bench::MnistNet();
  auto wrapped = std::make_shared<dtrain::bench::MnistNetImpl>();
  at::set_num_threads(replicas);  // before DataParallel: its replica threads leave this alone
  dtrain::DataParallel dp(wrapped, dtrain::DataParallelOptions().cpu_replicas(replicas));
  std::vector<double> threads_n, threads_1, data_parallel, ratio;
  std::printf("%-4s %16s %16s %16s %10s\n", "run", "1proc_1thr/s", "1proc_Nthr/s", "dp_cpu/s",
              "dp/Nthr");
  for (int r = 0; r < runs; ++r) {
    // Interleaved, the order alternating, so drift hits all three alike.
    double one = 0, many = 0, par = 0;
    auto run_dp = [&] {
      par = train_samples_per_s(*wrapped, [&](const torch::Tensor& in) { return dp.forward(in); }, x,
                                y, steps);
    };
    auto run_single = [&] {
      at::set_num_threads(1);
      one = train_samples_per_s(*single, [&](const torch::Tensor& in) { return single->forward(in); },
                                x, y, steps);
      at::set_num_threads(replicas);
      many = train_samples_per_s(*single, [&](const torch::Tensor& in) { return single->forward(in); },
                                 x, y, steps);
    };
    if (r % 2 == 0) run_single(), run_dp();
    else run_dp(), run_single();
    threads_1.push_back(one), threads_n.push_back(many), data_parallel.push_back(par);
    ratio.push_back(par / many);
    std::printf("%-4d %16.1f %16.1f %16.1f %10.3f\n", r, one, many, par, par / many);
    std::fflush(stdout);
  }
  double load[1] = {0};
  getloadavg(load, 1);  // other work on the machine skews every column
  std::printf("median samples/s: one module 1 thread %.1f, one module %d intra-op threads %.1f, "
              "DataParallel %d CPU replicas %.1f; median ratio DataParallel / %d threads = %.3f "
              "(MNIST convnet, batch %d, %d steps per run, %d runs, %u cores, load average %.2f)\n",
              median(threads_1), replicas, median(threads_n), replicas, median(data_parallel),
              replicas, median(ratio), batch, steps, runs, std::thread::hardware_concurrency(),
              load[0]);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  try {
    if (cmd == "rank" && argc > 2 && is_memory_mode(argv[2]))
      return memory_rank_main(argv[2], parse(argc, argv, 3));
    if (cmd == "rank" && argc > 2 && is_composed_mode(argv[2]))
      return composed_rank_main(argv[2], parse(argc, argv, 3));
    if (cmd == "rank" && argc > 2 && is_pipeline_mode(argv[2]))
      return pipeline_rank_main(argv[2], parse(argc, argv, 3));
    if (cmd == "rank" && argc > 2 && is_tp_mode(argv[2])) return tp_rank_main(argv[2], parse(argc, argv, 3));
    if (cmd == "rank" && argc > 2 && std::string(argv[2]) == "local-sgd-ref")
      return local_sgd_reference_rank_main(parse(argc, argv, 3));
    if (cmd == "rank" && argc > 2 && std::string(argv[2]) == "slow-links")
      return slow_links_rank_main(parse(argc, argv, 3));
    if (cmd == "rank" && argc > 2 && is_ep_mode(argv[2])) return ep_rank_main(argv[2], parse(argc, argv, 3));
    if (cmd == "rank" && argc > 2 && is_cp_mode(argv[2])) return cp_rank_main(argv[2], parse(argc, argv, 3));
    if (cmd == "rank" && argc > 2 && is_cuda_mode(argv[2])) return cuda_rank_main(argv[2], parse(argc, argv, 3));
    if (cmd == "rank" && argc > 2 && is_ft_mode(argv[2])) return ft_rank_main(argv[2], parse(argc, argv, 3));
    if (cmd == "rank" && argc > 2 && is_checkpoint_mode(argv[2]))
      return checkpoint_rank_main(argv[2], parse(argc, argv, 3));
    if (cmd == "rank" && argc > 2) return rank_main(argv[2], parse(argc, argv, 3));
    // collectives runs in every rank of a job: its rank 0 prints this.
    if (cmd != "rank" && cmd != "collectives") std::printf("%s\n", build_line().c_str());
    if (cmd == "memory") return bench_memory(parse(argc, argv, 2));
    if (cmd == "cuda") return bench_cuda(parse(argc, argv, 2));
    if (cmd == "ft") return bench_ft(parse(argc, argv, 2));
    if (cmd == "pipeline") return bench_pipeline(parse(argc, argv, 2));
    if (cmd == "tp") return bench_tp(parse(argc, argv, 2));
    if (cmd == "ep") return bench_ep(parse(argc, argv, 2));
    if (cmd == "cp") return bench_cp(parse(argc, argv, 2));
    if (cmd == "checkpoint") return bench_checkpoint(parse(argc, argv, 2));
    if (cmd == "composed") return bench_composed(parse(argc, argv, 2));
    if (cmd == "slow-links") return bench_slow_links(parse(argc, argv, 2));
    if (cmd == "ddp") return bench_ddp(parse(argc, argv, 2));
    if (cmd == "overlap") return bench_overlap(parse(argc, argv, 2));
    if (cmd == "dp") return bench_dp(parse(argc, argv, 2));
    if (cmd == "syncbn") return bench_syncbn(parse(argc, argv, 2));
    if (cmd == "collectives") return bench_collectives(parse(argc, argv, 2));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain-bench: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "usage: dtrain-bench ddp|overlap|dp|syncbn|memory|pipeline|tp|ep|cp|checkpoint|composed|slow-links|cuda|ft|collectives [--flag value ...] (see the source header)\n");
  return 2;
}
