#pragma once

// One gradient bucket of the reducer (shared by reducer.cpp and
// reducer_sharded.cpp).

#include <ATen/ATen.h>

#include <chrono>
#include <vector>

#include "ddp/reducer.h"

namespace dtrain::ddp {

using Clock = std::chrono::steady_clock;

struct Reducer::Bucket {
  std::vector<size_t> members;  // parameter indices, in slot order
  GradBucket grad;              // what the comm hook sees
  int64_t numel = 0;            // of the gradients (the buffer may be padded, or absent)
  int64_t bytes = 0;
  at::Tensor scratch;           // shard_gradients: the share when it is added, not written
  size_t pending = 0;           // members not ready yet this iteration
  bool ready = false;
  WorkPtr work;
  Clock::time_point readied, launched, done;
};

}  // namespace dtrain::ddp
