#pragma once

// Shared by rank_worker's source files (rank_worker.cpp says what each
// mode does).

#include <cstdlib>
#include <iostream>
#include <string>

#include <torch/cuda.h>
#include <torch/types.h>

#include "dtrain/distributed.h"

inline int fail(const std::string& what) {
  std::cout << "FAILED rank " << dtrain::get_rank() << ": " << what << std::endl;
  return 1;
}

// Where an equivalence mode trains: the CPU, or with "cuda" among its
// arguments the GPU LOCAL_RANK % device count (ranks may share one GPU).
inline torch::Device worker_device(int argc, char** argv) {
  for (int i = 3; i < argc; ++i)
    if (std::string(argv[i]) == "cuda") {
      const char* local = std::getenv("LOCAL_RANK");
      const int count = static_cast<int>(torch::cuda::device_count());
      if (count == 0) throw std::runtime_error("rank_worker: 'cuda' asked for, but no GPU is visible");
      return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>((local ? std::atoi(local) : 0) % count));
    }
  return torch::Device(torch::kCPU);
}

// FSDP over every rank with the model built in full, or built under a
// ShardedConstruction; or HSDP over a (2, world / 2) mesh.
enum class FsdpVariant { kFull, kShardedConstruction, kHybrid };
int fsdp_equivalence(const std::string& backend, FsdpVariant variant, torch::Device device);
// SCHEDULE: gpipe, 1f1b, interleaved, looped-bfs or zbv.
int pipeline_equivalence(const std::string& schedule, const std::string& backend, torch::Device device);
// ZeRO-1 or ZeRO-2.
int zero_equivalence(const std::string& backend, int stage, torch::Device device);
int syncbn_equivalence(const std::string& backend, torch::Device device);
// rank_worker_parallel.cpp
int tp_equivalence(const std::string& backend, torch::Device device);
int ep_equivalence(const std::string& backend, torch::Device device);
int diloco_equivalence(const std::string& backend, torch::Device device);  // rank_worker_parallel.cpp
// Peers that leave (peer_leaves: every rank but 0 destroys its group; rank 0
// then idles 1 s and prints "rank 0 cpu_ms N") or die while rank 0 waits
// (recv_from_last: rank 0 receives from the last rank, which never sends).
// loop: all_reduce forever; p2p_loop: send/recv around a ring forever.
int loop(const std::string& backend);
int p2p_loop(const std::string& backend);
int peer_leaves(const std::string& backend);
int recv_from_last(const std::string& backend);
// checkpoint-crash DIR PHASE and checkpoint-check DIR (rank_worker_checkpoint.cpp).
int checkpoint_crash(const std::string& dir, const std::string& phase, bool check);
// page-faults, fsdp-malloc, mismatch, timeline, trace and trace-uncaught
// (rank_worker_diagnostics.cpp).
int page_faults(int steps);
int fsdp_malloc();
int mismatch();
int timeline_training();
int trace_fault(const std::string& backend, const std::string& fault);
int trace_uncaught();
