#pragma once

// Parameters as one flat tensor and back (averager.cpp, diloco.cpp): one
// collective for many tensors.

#include <ATen/ATen.h>

#include <vector>

namespace dtrain::local_sgd::detail {

// The parameters' values, flattened and concatenated (a copy).
inline at::Tensor flat_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> rows;
  for (const auto& p : params) rows.push_back(p.detach().reshape({-1}));
  return at::cat(rows);
}

// `flat`'s consecutive pieces copied into the parameters, in order.
inline void copy_into(const std::vector<at::Tensor>& params, const at::Tensor& flat) {
  int64_t offset = 0;
  for (const auto& p : params) {
    p.detach().copy_(flat.narrow(0, offset, p.numel()).view_as(p));
    offset += p.numel();
  }
}

}  // namespace dtrain::local_sgd::detail
