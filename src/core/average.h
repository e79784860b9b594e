#pragma once

// AVG for backends whose transport only sums: divide the sum by the group
// size afterwards, truncating toward zero for integers (torch's
// div(..., "trunc")), in place.

#include <ATen/ATen.h>

namespace dtrain {

inline void divide_for_average(const at::Tensor& t, int size) {
  if (at::isFloatingType(t.scalar_type())) {
    t.div_(size);
  } else {
    // In int64: ATen would narrow the divisor to t's dtype (128 is -128 as
    // int8, 256 is 0 as uint8: ZeroDivisionError). The quotient fits t again.
    t.copy_(t.to(at::kLong).div(size, "trunc"));
  }
}

}  // namespace dtrain
