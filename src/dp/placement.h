#pragma once

// Where DataParallel's replicas live: options validated and resolved to one
// device per replica, and how a batch is divided among them.

#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

#include "dtrain/data_parallel.h"

namespace dtrain::dp {

struct Placement {
  bool cpu = false;                   // cpu_replicas mode
  std::vector<c10::Device> devices;   // one per replica; devices[0] holds the module
  c10::Device output{c10::kCPU};      // where outputs are gathered
};

// Throws InvalidArgument for contradictory options, device ids that do not
// exist or repeat, and for CUDA mode without any CUDA device.
Placement resolve_placement(const DataParallelOptions& options);

// Sizes of min(replicas, total) chunks of `total` rows, differing by at most
// one, larger first (torch.tensor_split's rule). total > 0, replicas > 0.
std::vector<int64_t> chunk_sizes(int64_t total, int64_t replicas);

}  // namespace dtrain::dp
