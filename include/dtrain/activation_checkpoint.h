#pragma once

// Activation checkpointing (PyTorch's torch.utils.checkpoint): a segment of
// the model keeps no activations between its forward and its backward; the
// backward runs the segment's forward again to get them. Memory for compute:
// a segment's activations live only while its own backward runs.
//
//   struct Net : torch::nn::Module {
//     at::Tensor forward(at::Tensor x) {
//       for (auto& block : blocks)
//         x = dtrain::activation_checkpoint([&](at::Tensor h) { return block->forward(h); }, x);
//       return head->forward(x);
//     }
//   };
//
// The gradients are those of the segment run plainly. The random number
// generators (the CPU's, the input's CUDA device's, and the tensor-parallel
// streams of tensor_parallel_rng.h) are put back to their state at the
// forward for the recomputation, so that dropout draws
// the same mask twice; preserve_rng_state(false) skips that, as PyTorch's
// option does.
//
// This is PyTorch's reentrant form: the recomputation runs a backward of
// its own inside the enclosing one, and the parameters the segment uses get
// their gradients from it (accumulated into .grad). So gradients reach
// parameters through backward() and the optimizers, not through
// torch::autograd::grad(outputs, parameters). DistributedDataParallel
// composes with it (its reduction waits for the enclosing backward): put the
// checkpoints inside the wrapped module's forward, not around ddp.forward.
// So does FullyShardedDataParallel: a FullyShard unit run as a segment
// gathers its parameters again for the recomputation.
// Under torch::NoGradGuard the segment simply runs. The segment must
// compute the same thing twice (no state that changes between the two
// runs, other than the random number generators), and it runs again in the
// backward: what it captures must still exist then. Capture loop indices
// and other locals by value; `[&]` is right for objects that outlive the
// backward (the modules, a range-for's reference to one, as above).
//
// Selective checkpointing (PyTorch's create_selective_checkpoint_contexts):
// with a policy, the segment keeps the outputs of the matrix multiplies the
// policy chooses, and the recomputation hands them back instead of
// computing them again; the element-wise work between them is recomputed.
// The gradients are bitwise those of the segment run plainly.
//
//   x = dtrain::activation_checkpoint(run_block, x,
//       dtrain::ActivationCheckpointOptions().policy(dtrain::keep_matmul_outputs()));
//
// libtorch has no C++ dispatch mode to watch every operation with, so the
// policy sees the matrix multiplies that dtrain runs: dtrain::linear below
// (use it where the model calls torch::nn::functional::linear or a
// torch::nn::Linear) and the tensor-parallel layers. A RowParallelLinear's
// kept output is its reduced one, so its collective is not run again
// either. Every other operation is recomputed.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

#include "dtrain/arg.h"

namespace dtrain {

// A matrix multiply that a selective checkpoint's policy is asked about.
struct CheckpointedOp {
  // "linear" (dtrain::linear), "ColumnParallelLinear" or "RowParallelLinear".
  const char* kind;
  // Its place among the segment's matrix multiplies, counting from 0.
  int64_t index;
};

// True: keep the op's output for the backward; false: recompute it. Under
// tensor parallelism it must decide alike on every rank of the group (a
// RowParallelLinear recomputed on one rank only would run its collective
// there alone). An output that is the segment's own is recomputed whatever
// the policy says: the caller may change it in place.
using CheckpointPolicy = std::function<bool(const CheckpointedOp&)>;

// Keeps every matrix multiply's output (torchtitan's "op" policy without
// its every-other-one rule: write a CheckpointPolicy for that).
CheckpointPolicy keep_matmul_outputs();

// torch::nn::functional::linear(input, weight, bias): input @ weight^T +
// bias, computed as one matrix multiply (addmm) over the input folded to
// 2-D, as the tensor-parallel layers compute theirs (at::linear does the
// same for 2-D inputs and contiguous 3-D ones with a bias; for other
// shapes the last bits can differ from it). A selective checkpoint's
// policy sees it; elsewhere it is plain linear.
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias = {});

struct ActivationCheckpointOptions {
  // Put the CPU's and the input's CUDA device's generators back to their
  // state at the forward while the segment is recomputed.
  DTRAIN_ARG(bool, preserve_rng_state) = true;
  // Selective checkpointing: which matrix multiplies' outputs to keep.
  // Unset: none, the whole segment is recomputed.
  DTRAIN_ARG(CheckpointPolicy, policy) = nullptr;
};

// segment(input), keeping only `input` for the backward.
at::Tensor activation_checkpoint(const std::function<at::Tensor(at::Tensor)>& segment,
                                 const at::Tensor& input,
                                 const ActivationCheckpointOptions& options = {});

}  // namespace dtrain
