#pragma once

// Hugging Face's safetensors format, torch-free: reading a file's header
// (checked against the file's real size before anything is allocated for
// it) and writing one. The published format, in short:
//
//   0   8  N, the header's length (unsigned, little-endian), at most 100,000,000
//   8   N  the header: a JSON object; each key a tensor's name, its value
//          {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}
//          (offsets into the data, end exclusive); the key "__metadata__"
//          an object of string values. Trailing spaces pad it.
//   8+N    the data: the tensors' bytes, little-endian, row-major; every
//          byte belongs to exactly one tensor.
//
// A hostile file (a header length past the end of the file or over the
// limit, JSON that is not this shape, an unknown dtype, a shape whose size
// overflows, offsets that do not match the shape, overlap, leave a hole or
// run out of the data) is an InvalidArgument "safetensors <what>: <problem>",
// naming the tensor and the field.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::safetensors {

inline constexpr uint64_t kMaxHeaderBytes = 100000000;  // the format's limit
inline constexpr size_t kMaxTensors = 1u << 20;
inline constexpr size_t kMaxDims = 64;

// The dtypes dtrain reads and writes (the format's others, such as U16 or
// F8_E4M3, are named as unsupported).
enum class DType { Bool, UInt8, Int8, Int16, Int32, Int64, Float16, BFloat16, Float32, Float64 };
const char* dtype_name(DType type);  // the format's: "F32", ...
size_t element_size(DType type);

struct Entry {
  std::string name;
  DType dtype = DType::Float32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // in the data
};

struct Layout {
  std::vector<Entry> tensors;  // in the header's order
  std::vector<std::pair<std::string, std::string>> metadata;
  uint64_t data_start = 0, data_bytes = 0;
};

// Reads exactly `n` bytes at `offset` into `out`, or throws.
using ReadAt = std::function<void(uint64_t offset, size_t n, void* out)>;

// Parses and checks the header of a file of `file_size` bytes.
Layout read_layout(const std::string& what, uint64_t file_size, const ReadAt& read);

// The 8-byte length and the header of a file holding `tensors` in order
// (their offsets are set here, packed from 0) and `metadata`, padded with
// spaces so that the data starts at a multiple of 8. Checks names (non-empty,
// unique, not "__metadata__") and shapes.
std::string encode_prefix(std::vector<Entry>& tensors,
                          const std::vector<std::pair<std::string, std::string>>& metadata);

// `s` as a JSON string literal (quotes, backslashes and control characters
// escaped).
std::string json_string(const std::string& s);

}  // namespace dtrain::safetensors
