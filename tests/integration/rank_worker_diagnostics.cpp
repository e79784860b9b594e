// rank_worker's modes about memory (page faults, malloc's mappings) and
// diagnostics (a mismatch, the timeline, faults for the flight recorder);
// rank_worker.cpp lists every mode.

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <malloc.h>
#include <signal.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "dtrain/dtrain.h"
#include "harness/fsdp_models.h"
#include "integration/rank_worker.h"

namespace {

long minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

}  // namespace

int page_faults(int steps) {
  dtrain::init_process_group();
  torch::manual_seed(0);
  // Training steps of cheap element-wise work on 64 MiB tensors: the
  // activations and gradients are freed and allocated again every step.
  // Above 32 MiB, the most glibc's dynamic mmap threshold can rise to, so
  // glibc's defaults map every one afresh.
  auto w = torch::randn({16 << 20}, torch::requires_grad());
  auto x = torch::randn({16 << 20});
  torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.01).momentum(0.9));
  // The fewest faults of any 5-step window once the heap has settled: a
  // heap that still grows (its free blocks fragmented by small objects)
  // faults in a tensor now and then, but steady steps fault none.
  long fewest = -1;
  long window_start = 0;
  for (int step = 0; step < steps; ++step) {
    if (step >= 10 && step % 5 == 0) {
      const long now = minor_faults();
      if (step > 10 && (fewest < 0 || now - window_start < fewest)) fewest = now - window_start;
      window_start = now;
    }
    opt.zero_grad();
    ((x * w).relu() * (x + 1)).sum().backward();
    opt.step();
  }
  const long last = minor_faults() - window_start;
  if (fewest < 0 || last < fewest) fewest = last;
  std::printf("faults %ld\n", fewest);
  dtrain::destroy_process_group();
  return 0;
}

// Bytes of a 48 MiB tensor's block that malloc mapped on its own (glibc's
// mallinfo2 hblkhd), before and after FSDP is built: "mapped A B".
int fsdp_malloc() {
  dtrain::init_process_group();
  auto mapped_bytes_of_a_block = [] {
    const auto before = mallinfo2().hblkhd;
    auto t = at::empty({12 << 20});  // 48 MiB
    return static_cast<long long>(mallinfo2().hblkhd - before);
  };
  const long long before = mapped_bytes_of_a_block();
  torch::manual_seed(0);
  dtrain::FullyShardedDataParallel fsdp(std::make_shared<dtrain::testing::ShardedMLPImpl>());
  std::printf("mapped %lld %lld\n", before, mapped_bytes_of_a_block());
  dtrain::destroy_process_group();
  return 0;
}

int mismatch() {
  dtrain::init_process_group();
  auto t = at::ones({8});
  if (dtrain::get_rank() % 2 == 0) {
    dtrain::all_reduce(t);
  } else {
    dtrain::broadcast(t, 0);
  }
  std::cout << "rank " << dtrain::get_rank() << " ran a mismatched collective unnoticed" << std::endl;
  return 0;
}

// DDP over small buckets for 6 steps with the optimizer step as a timeline
// span; prints the sum of DDPStats::communication_ms over the steps.
int timeline_training() {
  dtrain::init_process_group();
  const int rank = dtrain::get_rank();
  torch::manual_seed(0);
  auto net = torch::nn::Sequential(torch::nn::Linear(10, 256), torch::nn::ReLU(),
                                   torch::nn::Linear(256, 256), torch::nn::ReLU(),
                                   torch::nn::Linear(256, 4));
  dtrain::DistributedDataParallel ddp(net.ptr(), dtrain::DDPOptions().bucket_cap_mb(0.1));
  torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.01));
  auto x = torch::randn({32, 10}), y = torch::randn({32, 4});
  double comm_ms = 0;
  for (int step = 0; step < 6; ++step) {
    opt.zero_grad();
    torch::mse_loss(ddp.forward(x), y).backward();
    comm_ms += ddp.stats().communication_ms;
    dtrain::TimelineSpan span("optimizer.step");
    opt.step();
  }
  std::printf("rank %d comm_ms %.6f\n", rank, comm_ms);
  std::fflush(stdout);
  dtrain::destroy_process_group();
  return 0;
}

int trace_fault(const std::string& backend, const std::string& fault) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  const int rank = dtrain::get_rank();
  for (int i = 0; i < 5; ++i) {
    if (i == 3) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::system_clock::now().time_since_epoch());
      std::cout << "rank " << rank << " fault at " << ms.count() << std::endl;
      if (rank == 1 && fault == "stop") raise(SIGSTOP);
      if (rank == 1 && (fault == "exit" || fault == "exit-idle")) std::_Exit(5);
      // The others compute for a while: only a launcher's SIGUSR2 dumps them.
      if (fault == "exit-idle") std::this_thread::sleep_for(std::chrono::seconds(30));
      // Rank 1 computes for long: the others time out waiting for it.
      if (rank == 1 && fault == "slow") std::this_thread::sleep_for(std::chrono::seconds(30));
      // Every rank computes for long: only a signal ends them.
      if (fault == "idle") std::this_thread::sleep_for(std::chrono::seconds(30));
    }
    if (rank == 1 && fault == "skip" && i == 2) continue;
    auto t = at::ones({rank == 2 && fault == "shape" && i == 3 ? 5 : 4});
    dtrain::all_reduce(t);
  }
  dtrain::barrier();
  std::cout << "rank " << rank << " finished without noticing the fault" << std::endl;
  return 0;
}

// A data-dependent branch: rank 2 skips the last all_reduce. Nothing here
// catches the others' TimeoutError, as in most programs.
int trace_uncaught() {
  dtrain::init_process_group();
  const int rank = dtrain::get_rank();
  for (int i = 0; i < 5; ++i) {
    if (rank == 2 && i == 4) break;
    auto t = at::ones({4});
    dtrain::all_reduce(t);
  }
  if (rank == 2) std::this_thread::sleep_for(std::chrono::seconds(60));
  std::cout << "rank " << rank << " finished without noticing the fault" << std::endl;
  return 0;
}
