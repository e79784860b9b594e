#pragma once

// cpu mode's forward: replicas on CPU threads, in forward and in backward.

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "dp/replica_pool.h"
#include "dp/replicas.h"

namespace dtrain::dp {

// Splits `input` along `dim` into chunks of `sizes` (one per replica, at
// least two), runs replica i on chunk i on pool thread i, and returns the
// outputs concatenated along `dim`. When gradients are needed the result's
// grad_fn runs the replicas' backward on the pool as well and delivers the
// summed parameter gradients to the original module (see cpu_parallel.cpp).
at::Tensor cpu_parallel_forward(ReplicaSet& replicas, const std::shared_ptr<ReplicaPool>& pool,
                                const at::Tensor& input, const std::vector<int64_t>& sizes,
                                int64_t dim);

}  // namespace dtrain::dp
