#pragma once

// Exact collective results: inputs of small integers, exact in every dtype,
// and each reduction computed independently in double precision.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "dtrain/operation.h"

namespace dtrain::testing {

inline const std::vector<ReduceOp> kOps = {ReduceOp::SUM, ReduceOp::AVG,
                                           ReduceOp::PRODUCT, ReduceOp::MIN,
                                           ReduceOp::MAX};

// kOps, and for integer dtypes the bitwise ones too.
inline std::vector<ReduceOp> ops_for(at::ScalarType dtype) {
  auto ops = kOps;
  if (at::isIntegralType(dtype, false))
    ops.insert(ops.end(), {ReduceOp::BAND, ReduceOp::BOR, ReduceOp::BXOR});
  return ops;
}

// n elements repeating `period` (a 1-D tensor), made by doubling copies:
// memcpy's speed, where elementwise arithmetic over the whole length was
// most of the large tests' time on 2 cores.
inline at::Tensor tiled(const at::Tensor &period, int64_t n) {
  auto out = at::empty({n}, period.options());
  const int64_t p = std::min<int64_t>(period.numel(), n);
  if (p == 0)
    return out;
  out.narrow(0, 0, p).copy_(period.narrow(0, 0, p));
  for (int64_t have = p; have < n; have *= 2) {
    const int64_t take = std::min(have, n - have);
    out.narrow(0, have, take).copy_(out.narrow(0, 0, take));
  }
  return out;
}

// Rank r's element i: small integers, exact in every dtype.
// ((i + r) mod 3) + 1, so every input repeats with period 3.
inline at::Tensor input_period(int rank, at::ScalarType dtype) {
  auto i = at::arange(3, at::kDouble);
  return (at::fmod(i + rank, 3) + 1).to(dtype);
}

inline at::Tensor input(int rank, int64_t n, at::ScalarType dtype) {
  return tiled(input_period(rank, dtype), n);
}

// Elementwise over inputs of period 3: computed over one period, then tiled.
inline at::Tensor expected_reduction(int world, int64_t n, at::ScalarType dtype,
                                     ReduceOp op) {
  auto acc = input_period(0, at::kDouble);
  for (int r = 1; r < world; ++r) {
    auto x = input_period(r, at::kDouble);
    switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
      acc = acc + x;
      break;
    case ReduceOp::PRODUCT:
      acc = acc * x;
      break;
    case ReduceOp::MIN:
      acc = at::minimum(acc, x);
      break;
    case ReduceOp::MAX:
      acc = at::maximum(acc, x);
      break;
    case ReduceOp::BAND:
      acc = acc.to(at::kLong).bitwise_and(x.to(at::kLong)).to(at::kDouble);
      break;
    case ReduceOp::BOR:
      acc = acc.to(at::kLong).bitwise_or(x.to(at::kLong)).to(at::kDouble);
      break;
    case ReduceOp::BXOR:
      acc = acc.to(at::kLong).bitwise_xor(x.to(at::kLong)).to(at::kDouble);
      break;
    }
  }
  if (op != ReduceOp::AVG)
    acc = acc.to(dtype);
  else if (at::isFloatingType(dtype))
    acc = acc.to(dtype).div(world);
  else
    acc = acc.div(world, "trunc").to(dtype);
  return tiled(acc, n);
}

inline void expect_equal(const at::Tensor &actual, const at::Tensor &expected,
                         const std::string &what) {
  ASSERT_EQ(actual.scalar_type(), expected.scalar_type()) << what;
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(at::equal(actual, expected))
      << what << "\nactual:   " << actual.flatten().slice(0, 0, 8)
      << "\nexpected: " << expected.flatten().slice(0, 0, 8);
}

} // namespace dtrain::testing
