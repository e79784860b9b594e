#pragma once

// A tensor that shares `base`'s memory from element `offset` on, shaped
// `sizes` (contiguous), without being an autograd view of it: libtorch's
// Optimizer::zero_grad detach_()es gradients, which views refuse. Used for
// gradients that live inside a larger buffer (DDP's buckets, ZeRO-2's
// shares).

#include <ATen/ATen.h>

namespace dtrain::detail {

inline at::Tensor storage_alias(const at::Tensor& base, int64_t offset, at::IntArrayRef sizes) {
  return at::empty({0}, base.options())
      .set_(base.storage(), base.storage_offset() + offset, sizes, at::detail::defaultStrides(sizes));
}

}  // namespace dtrain::detail
