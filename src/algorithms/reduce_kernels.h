#pragma once

// Element-wise reductions (shared by the shm backend and the algorithms
// over transports) of several source buffers into one, for every
// dtype and ReduceOp of the communication core. Compiled at -O3 with an AVX2
// clone on x86-64 (picked at load time), so the loops run vectorized where
// the CPU allows and everywhere else still work.
//
// Sources are combined in the order given (rank order), so every rank that
// reduces the same region gets bitwise the same result. Integer SUM and
// PRODUCT wrap (two's complement) as in PyTorch, computed without signed
// overflow; AVG truncates toward zero for integers. float16 and bfloat16 are
// accumulated in float32 and rounded once (more accurate than pairwise
// rounding, and still deterministic).

#include <c10/core/ScalarType.h>

#include <cstddef>

#include "dtrain/process_group.h"

namespace dtrain::kernels {

// dst[i] = op(srcs[0][i], ..., srcs[nsrcs-1][i]) for i < count; AVG then
// divides by `divisor` (as an int, never narrowed to the element type).
// When dst2 is not null it receives the same result (in the same pass where
// it can). dst must not overlap any source or dst2;
// dst2 may be exactly one of the sources (in place: each element is read
// before it is written) and must not overlap the others.
void reduce_into(c10::ScalarType dtype, ReduceOp op, void* dst, void* dst2,
                 const void* const* srcs, int nsrcs, size_t count, int divisor);

// Whether reduce_into / accumulate_into handle this dtype (they throw
// InvalidArgument for the others).
bool can_reduce(c10::ScalarType dtype);

// acc[i] = op(acc[i], src[i]) for i < count (AVG sums; the caller divides).
// acc and src must not overlap. float16/bfloat16 are combined in float32 and
// rounded at each call.
void accumulate_into(c10::ScalarType dtype, ReduceOp op, void* acc, const void* src,
                     size_t count);

// data[i] /= divisor for i < count, as torch's div_ (floating types: in
// float32 for float16 and bfloat16, rounded once) and div(..., "trunc")
// (integers, toward zero): what AVG does to a sum.
void divide_by(c10::ScalarType dtype, void* data, size_t count, int divisor);

}  // namespace dtrain::kernels
