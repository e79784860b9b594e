#pragma once

// Reader for gzip-compressed IDX files (the MNIST family's format: a
// big-endian header of magic, then one uint32 per dimension, then the
// unsigned bytes), through zlib's gzread so no unpacked copy is needed.

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::data {

// What the file must hold; anything else is an InvalidArgument naming the
// file, the expectation and what was found.
struct IdxSpec {
  uint32_t magic = 0;              // 2051 (ubyte, 3 dims), 2049 (ubyte, 1 dim)
  std::string item_name;           // "images", "labels": for messages
  int64_t count = 0;               // first dimension
  std::vector<int64_t> item_dims;  // the other dimensions, e.g. {28, 28}
};

inline constexpr uint32_t kIdxImagesMagic = 2051;
inline constexpr uint32_t kIdxLabelsMagic = 2049;

// The whole file as a uint8 tensor [count, item_dims...]. Checks the
// header against `spec`, that the data holds exactly `count` items (no
// short file, no trailing bytes) and that the gzip stream is intact.
at::Tensor read_idx_gz(const std::string& path, const IdxSpec& spec);

}  // namespace dtrain::data
