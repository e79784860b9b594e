#pragma once

// For tests of tensor-parallel layers against one process: a rank's shard
// of a whole tensor, a copy of a Linear, and closeness to 1e-5 relative.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>

namespace dtrain::testing {

inline torch::nn::Linear copy_of(const torch::nn::Linear& l) {
  return std::dynamic_pointer_cast<torch::nn::LinearImpl>(l->clone());
}

// Within 1e-5 of `want`, relative to its largest magnitude.
inline void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = std::max(want.abs().max().item<double>(), 1e-12);
  EXPECT_LE((got - want).abs().max().item<double>() / scale, 1e-5) << what;
}

// Slice [r n/t, (r+1) n/t) of `t` along `dim`.
inline at::Tensor shard(const at::Tensor& t, int64_t dim, int rank, int ranks) {
  const int64_t part = t.size(dim) / ranks;
  return t.narrow(dim, rank * part, part);
}

}  // namespace dtrain::testing
