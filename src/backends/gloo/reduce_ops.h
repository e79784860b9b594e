#pragma once

// Element-wise reduction kernels for Gloo, one per (dtype, op). Gloo calls
// them as fn(out, a, b, n): out[i] = a[i] op b[i]. Half and BFloat16 are
// combined in float and rounded once. AVG is SUM here; the caller divides.

#include <c10/core/ScalarType.h>

#include <cstddef>

#include "dtrain/process_group.h"

namespace dtrain::gloo_backend {

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

ReduceFn reduce_function(c10::ScalarType dtype, ReduceOp op);

}  // namespace dtrain::gloo_backend
