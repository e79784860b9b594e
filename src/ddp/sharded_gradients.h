#pragma once

// DDPOptions::shard_gradients (ZeRO-2): what DDP's reducer and the
// ZeroRedundancyOptimizer built over that DDP share.
//
// The layout is DDP's buckets, fixed at construction. Bucket b holds
// `numel` gradient elements (its members' gradients back to back, in
// `members` order); it is padded to world * slice elements and
// reduce-scattered, so rank r receives elements [r * slice, (r + 1) * slice)
// of the bucket's average. `grad` is this rank's shares of every bucket,
// concatenated: bucket b's at [shard_offset, shard_offset + slice). The
// optimizer keeps the parameters' values in the same layout.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace dtrain::ddp {

struct ShardedGradients {
  struct Bucket {
    std::vector<size_t> members;  // indices into the DDP's parameters
    int64_t numel = 0;
    int64_t slice = 0;         // ceil(numel / world)
    int64_t shard_offset = 0;  // where this rank's share starts in `grad`
  };
  std::vector<Bucket> buckets;
  int world = 1;
  at::Tensor grad;       // this rank's shares of the averaged gradients
  bool pending = false;  // `grad` holds gradients no optimizer step has used yet
  bool attached = false;  // a ZeroRedundancyOptimizer steps on `grad`
};

}  // namespace dtrain::ddp
