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
    t.copy_(t.div(size, "trunc"));
  }
}

}  // namespace dtrain
