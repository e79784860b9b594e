#pragma once

// Exact collective results: inputs of small integers, exact in every dtype,
// and each reduction computed independently in double precision.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

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

// Rank r's element i: small integers, exact in every dtype.
inline at::Tensor input(int rank, int64_t n, at::ScalarType dtype) {
  auto i = at::arange(n, at::kDouble);
  return (at::fmod(i + rank, 3) + 1).to(dtype);
}

inline at::Tensor expected_reduction(int world, int64_t n, at::ScalarType dtype,
                                     ReduceOp op) {
  auto acc = input(0, n, at::kDouble);
  for (int r = 1; r < world; ++r) {
    auto x = input(r, n, at::kDouble);
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
    return acc.to(dtype);
  if (at::isFloatingType(dtype))
    return acc.to(dtype).div(world);
  return acc.div(world, "trunc").to(dtype);
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
