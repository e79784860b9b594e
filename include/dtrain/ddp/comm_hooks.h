#pragma once

// Communication hooks: how DistributedDataParallel turns a bucket of local
// gradients into the average over ranks (PyTorch's register_comm_hook).
//
// Contract: a hook receives the group and one bucket, and must leave in
// bucket.buffer the gradient to use — normally sum over ranks / divisor.
// Hooks run on the DDP's communication thread, one bucket at a time, in
// bucket order on every rank, so a hook may issue several collectives and
// wait for them (PowerSGD does) without ranks disagreeing on their order;
// meanwhile backward keeps computing on its own thread.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dtrain/arg.h"
#include "dtrain/process_group.h"

namespace dtrain {

struct GradBucket {
  // Buckets are numbered in launch order. DDP rebuilds them once, after the
  // first iteration, so bucket i may hold other parameters from then on:
  // key per-parameter state by parameter_names (unique, stable) instead.
  int index = 0;
  bool is_last = false;
  int64_t iteration = 0;    // synchronized backward passes before this one
  double divisor = 1;       // world size (or ranks still training, see JoinOptions)
  at::Tensor buffer;        // flat, contiguous, one dtype
  std::vector<at::Tensor> gradients;       // views of buffer shaped like the parameters
  std::vector<std::string> parameter_names;
};

using CommHook = std::function<void(ProcessGroup& group, GradBucket& bucket)>;

// The default: buffer /= divisor, then all_reduce(SUM).
CommHook allreduce_hook();
// All-reduce in float16 / bfloat16 (half the bytes), result cast back.
CommHook fp16_compress_hook();
CommHook bf16_compress_hook();

struct PowerSGDOptions {
  // Rank of the low-rank approximation of each gradient matrix.
  DTRAIN_ARG(int, matrix_approximation_rank) = 1;
  // Plain all_reduce for this many iterations first (warm-up).
  DTRAIN_ARG(int64_t, start_powersgd_iter) = 10;
  // Compress a matrix only if it saves at least this factor of bytes.
  DTRAIN_ARG(double, min_compression_rate) = 2.0;
  // Add last iteration's compression error back before compressing.
  DTRAIN_ARG(bool, use_error_feedback) = true;
  // Reuse last iteration's Q as the starting point.
  DTRAIN_ARG(bool, warm_start) = true;
  // Seed of the random initial Q (must be the same on every rank).
  DTRAIN_ARG(uint64_t, seed) = 0;
};

// PowerSGD (Vogels et al., 2019): each gradient matrix M (n x m, after
// error feedback) is approximated as P Q^T with P = M Q all-reduced and
// orthogonalized, then Q = M^T P all-reduced; vectors (biases) and matrices
// too small to gain are all-reduced as they are. Keeps its state (Q,
// errors) in the returned hook, per parameter name, so that it survives
// DDP's bucket rebuild: any start_powersgd_iter works, 0 included.
CommHook powersgd_hook(const PowerSGDOptions& options = PowerSGDOptions());

}  // namespace dtrain
