#pragma once

// Device mode's forward (CUDA): one replica per device, plain autograd.

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "dp/replica_pool.h"
#include "dp/replicas.h"

namespace dtrain::dp {

// Copies the original parameters to devices[1..sizes.size()-1] with
// gradient links back to the originals, splits `input` along `dim` into
// chunks of `sizes`, moves chunk i to devices[i] and runs replica i there on
// pool thread i, then gathers the outputs along `dim` on `output`.
// Everything is ordinary autograd: the engine's per-device threads run the
// backward on all devices in parallel.
at::Tensor device_parallel_forward(ReplicaSet& replicas, ReplicaPool& pool,
                                   const std::vector<c10::Device>& devices, c10::Device output,
                                   const at::Tensor& input, const std::vector<int64_t>& sizes,
                                   int64_t dim);

}  // namespace dtrain::dp
