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

#include <ATen/core/Tensor.h>

#include <functional>

#include "dtrain/arg.h"

namespace dtrain {

struct ActivationCheckpointOptions {
  // Put the CPU's and the input's CUDA device's generators back to their
  // state at the forward while the segment is recomputed.
  DTRAIN_ARG(bool, preserve_rng_state) = true;
};

// segment(input), keeping only `input` for the backward.
at::Tensor activation_checkpoint(const std::function<at::Tensor(at::Tensor)>& segment,
                                 const at::Tensor& input,
                                 const ActivationCheckpointOptions& options = {});

}  // namespace dtrain
