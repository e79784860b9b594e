#pragma once

// The tensor-parallel random streams (tensor_parallel_rng.h) as a value:
// activation_checkpoint takes them at a segment's forward and puts them
// back for its recomputation.

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

namespace dtrain::tensor_parallel::detail {

using RngStreams = std::map<std::string, at::Tensor>;  // by device, each a generator state

RngStreams rng_streams();
void set_rng_streams(const RngStreams& streams);

}  // namespace dtrain::tensor_parallel::detail
