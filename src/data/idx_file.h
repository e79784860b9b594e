#pragma once

// The IDX reader of idx_reader.h, into a uint8 tensor.

#include <ATen/ATen.h>

#include <string>

#include "data/idx_reader.h"

namespace dtrain::data {

// The whole file as a uint8 tensor [count, item_dims...]; see read_idx_gz
// in idx_reader.h for what is checked.
at::Tensor read_idx_gz(const std::string& path, const IdxSpec& spec);

}  // namespace dtrain::data
