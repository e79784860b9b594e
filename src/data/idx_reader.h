#pragma once

// Reader for gzip-compressed IDX files (the MNIST family's format: a
// big-endian header of magic, then one uint32 per dimension, then the
// unsigned bytes), through zlib's gzread so no unpacked copy is needed.
// Torch-free: the caller allocates the destination once the header has
// been checked (idx_file.h wraps it into a tensor).

#include <cstdint>
#include <functional>
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

// Returns where to put the data of this shape ([count, item_dims...], as
// many bytes as its product): called once, after the header matched `spec`.
using IdxAllocate = std::function<uint8_t*(const std::vector<int64_t>& shape)>;

// Checks the header against `spec`, that the data holds exactly `count`
// items (no short file, no trailing bytes) and that the gzip stream is
// intact, reading the data into what `allocate` returned.
void read_idx_gz(const std::string& path, const IdxSpec& spec, const IdxAllocate& allocate);

}  // namespace dtrain::data
