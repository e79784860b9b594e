#pragma once

// Which parameters share a bucket. Pure bookkeeping, no torch: parameters
// are visited in the order their gradients are expected to become ready
// (reverse registration order at first, the observed order after the first
// iteration); each (dtype, device) kind fills its own open bucket, which is
// closed once it holds at least the cap — the first bucket of each kind
// uses the small first cap so that communication starts early in backward.

#include <cstddef>
#include <vector>

namespace dtrain::ddp {

struct ParamSlot {
  size_t bytes;
  int kind;  // parameters of different kinds never share a bucket
};

// Returns buckets (lists of parameter indices) in the order they close,
// which is the order they will be launched.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<ParamSlot>& params,
                                                const std::vector<size_t>& order,
                                                size_t first_cap_bytes, size_t cap_bytes);

// Reverse of registration order: 0..n-1 reversed.
std::vector<size_t> reverse_order(size_t n);

}  // namespace dtrain::ddp
