#pragma once

// The tensor file format, torch-free: a validated header and raw tensor
// bytes, with nothing in it that runs code when read (no pickle, no
// TorchScript). docs/tensor-file.md is the specification; in short, all
// integers little-endian:
//
//   0   8  magic "DTRNTENS"
//   8   4  version (1)
//   12  4  header size H (at most kMaxHeaderBytes)
//   16  8  data size D
//   24  H  header: metadata (string pairs), then one entry per tensor:
//          name, dtype code, shape, offset and size in the data, CRC-32
//   24+H 4 CRC-32 of bytes [0, 24+H)
//   then zero bytes up to a multiple of 64: the data starts there
//   then D bytes of tensor data, packed in entry order; the file ends there.
//
// Reading checks every size and count against the bytes that are really
// there before anything is allocated, so a hostile file costs at most its
// own size in memory, plus the bookkeeping of at most kMaxTensors tensors.
// A header damaged anywhere fails its CRC; each tensor's bytes are checked
// against its entry's CRC when read.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::tensor_file {

inline constexpr char kMagic[8] = {'D', 'T', 'R', 'N', 'T', 'E', 'N', 'S'};
inline constexpr uint32_t kVersion = 1;
inline constexpr size_t kPreambleBytes = 24;
inline constexpr size_t kDataAlignment = 64;
inline constexpr uint32_t kMaxHeaderBytes = 64u << 20;
inline constexpr size_t kMaxDims = 64;
inline constexpr size_t kMaxNameBytes = 4096;  // tensor names and metadata keys
// Each tensor costs a few hundred bytes of bookkeeping when read, beyond
// its data: the count is capped so that a header cannot multiply that.
inline constexpr uint32_t kMaxTensors = 1u << 20;

// Element types, with codes fixed by the format (not torch's numbering).
enum class DType : uint8_t {
  Float32 = 1, Float64, Float16, BFloat16, Int64, Int32, Int16, Int8, UInt8, Bool,
  Complex64, Complex128,
};
inline constexpr uint8_t kLastDType = 12;
size_t element_size(DType type);
const char* dtype_name(DType type);  // "float32", ...

struct Entry {
  std::string name;
  DType dtype = DType::Float32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // from the start of the data
  uint64_t bytes = 0;
  uint32_t crc = 0;     // CRC-32 of the tensor's bytes
};

struct Header {
  std::vector<std::pair<std::string, std::string>> metadata;
  std::vector<Entry> tensors;
};

// A validated file: where its data starts and how long it is.
struct Layout {
  Header header;
  uint64_t data_start = 0;
  uint64_t data_bytes = 0;
};

uint32_t crc32(const void* data, size_t bytes, uint32_t crc = 0);

// Element count times size, or throws InvalidArgument naming `what` when
// a dimension is negative or the product overflows.
uint64_t tensor_bytes(const std::string& what, DType type, const std::vector<int64_t>& shape);

// Packs the entries in order (sets each offset) and returns the data size;
// checks names (non-empty, unique, at most kMaxNameBytes) and ranks.
uint64_t assign_offsets(Header& header);

// Everything that precedes the data: preamble, header, its CRC, padding.
// Throws InvalidArgument when the header would exceed kMaxHeaderBytes.
std::string encode_prefix(const Header& header, uint64_t data_bytes);

// Reads exactly `n` bytes at `offset` into `out`, or throws.
using ReadAt = std::function<void(uint64_t offset, size_t n, void* out)>;

// Parses and checks the prefix of a file of `file_size` bytes. Errors are
// InvalidArgument "<what>: <problem>".
Layout read_layout(const std::string& what, uint64_t file_size, const ReadAt& read);

// Throws InvalidArgument "<what>: tensor <name> fails its checksum ..." when
// `data` (entry.bytes long) is not what was written.
void verify(const std::string& what, const Entry& entry, const void* data);

}  // namespace dtrain::tensor_file
