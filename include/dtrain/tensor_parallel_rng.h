#pragma once

// Random numbers under tensor parallelism (Megatron's model-parallel RNG
// tracker): where activations are whole on every rank of a tensor-parallel
// group (the residual stream without sequence parallelism), dropout must
// draw the same mask on each rank; where each rank holds a different part
// (its attention heads, its features of an MLP, its sequence shard under
// sequence parallelism), each rank must draw its own. So each rank keeps
// two streams per device: the default generator, seeded alike on every
// rank, and its tensor-parallel stream, seeded by its rank in the group.
//
//   namespace tp = dtrain::tensor_parallel;
//   tp::manual_seed(seed, mesh.get_group("tp"));
//   x = torch::dropout(x, p, train);             // the same mask on every TP rank
//   {
//     tp::ForkRng sharded;                        // this rank's stream
//     probs = torch::dropout(probs, p, train);    // a mask of its own
//   }
//
// Both streams are per process (the default generator is). A run seeded
// this way draws the same masks again for the same layout.
// activation_checkpoint puts the tensor-parallel streams back to their
// state at the forward for its recomputation, as it does the default
// generator, so a checkpointed segment that forks draws the same masks.

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>

#include "dtrain/process_group.h"

namespace dtrain::tensor_parallel {

// Seeds `device`'s default generator with `seed` (on every rank alike),
// and this rank's tensor-parallel stream for that device with
// seed + 2718 + its rank in `group` (null: the default group), as
// Megatron's model_parallel_cuda_manual_seed does. A CUDA device needs its
// index.
void manual_seed(uint64_t seed, const std::shared_ptr<ProcessGroup>& group = nullptr,
                 c10::Device device = c10::Device(c10::kCPU));

// While it lives, `device`'s default generator draws from this rank's
// tensor-parallel stream; when it ends, the stream keeps its place and the
// default generator is put back where it was. Not nested for one device;
// manual_seed must have seeded the device's stream (else InvalidArgument).
class ForkRng {
 public:
  explicit ForkRng(c10::Device device = c10::Device(c10::kCPU));
  ~ForkRng();
  ForkRng(const ForkRng&) = delete;
  ForkRng& operator=(const ForkRng&) = delete;

 private:
  c10::Device device_;
};

}  // namespace dtrain::tensor_parallel
