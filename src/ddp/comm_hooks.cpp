// Built-in communication hooks (see include/dtrain/ddp/comm_hooks.h).

#include "dtrain/ddp/comm_hooks.h"

#include <ATen/ATen.h>

namespace dtrain {
namespace {

// Divide before summing, as PyTorch does, so low-precision sums stay in range.
CommHook compressed(at::ScalarType wire_type) {
  return [wire_type](ProcessGroup& group, GradBucket& bucket) {
    auto wire = bucket.buffer.to(wire_type).div_(bucket.divisor);
    group.all_reduce(wire, ReduceOp::SUM)->wait();
    bucket.buffer.copy_(wire);
  };
}

}  // namespace

CommHook allreduce_hook() {
  return [](ProcessGroup& group, GradBucket& bucket) {
    bucket.buffer.div_(bucket.divisor);
    group.all_reduce(bucket.buffer, ReduceOp::SUM)->wait();
  };
}

CommHook fp16_compress_hook() { return compressed(at::kHalf); }

CommHook bf16_compress_hook() { return compressed(at::kBFloat16); }

}  // namespace dtrain
