#include "checkpoint/formats/tensor_file_format.h"

#include <zlib.h>

#include <cstring>
#include <limits>
#include <set>

#include "common/enforce.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "tensor files hold raw little-endian tensor bytes");

namespace dtrain::tensor_file {
namespace {

struct TypeInfo {
  const char* name;
  size_t size;
};
constexpr TypeInfo kTypes[kLastDType + 1] = {
    {"invalid", 0},  {"float32", 4}, {"float64", 8}, {"float16", 2},
    {"bfloat16", 2}, {"int64", 8},   {"int32", 4},   {"int16", 2},
    {"int8", 1},     {"uint8", 1},   {"bool", 1},    {"complex64", 8},
    {"complex128", 16}};

// --- writing: little-endian fields appended to a string ----------------------

template <typename T>
void put(std::string& out, T value) {
  for (size_t i = 0; i < sizeof(T); ++i)
    out.push_back(static_cast<char>((static_cast<uint64_t>(value) >> (8 * i)) & 0xff));
}

void put_string(std::string& out, const std::string& s) {
  put<uint32_t>(out, static_cast<uint32_t>(s.size()));
  out += s;
}

// --- reading: a cursor that never reads past the header ----------------------

class Cursor {
 public:
  Cursor(const std::string& what, const std::string& bytes) : what_(what), bytes_(bytes) {}

  template <typename T>
  T take(const char* field) {
    need(sizeof(T), field);
    uint64_t v = 0;
    for (size_t i = 0; i < sizeof(T); ++i)
      v |= uint64_t(static_cast<unsigned char>(bytes_[pos_ + i])) << (8 * i);
    pos_ += sizeof(T);
    return static_cast<T>(v);
  }

  std::string take_string(const char* field, size_t max) {
    const uint32_t n = take<uint32_t>(field);
    DTRAIN_CHECK_ARG(n <= max, what_, ": ", field, " of ", n, " bytes (at most ", max, ")");
    need(n, field);
    std::string s = bytes_.substr(pos_, n);
    pos_ += n;
    return s;
  }

  // A count of records of at least `min_bytes` each: more than the bytes
  // left could hold is refused before anything is reserved for them.
  uint32_t take_count(const char* field, size_t min_bytes) {
    const uint32_t n = take<uint32_t>(field);
    DTRAIN_CHECK_ARG(n <= left() / min_bytes, what_, ": header claims ", n, " ", field,
                     ", more than its ", left(), " remaining bytes can hold");
    return n;
  }

  size_t left() const { return bytes_.size() - pos_; }

 private:
  void need(size_t n, const char* field) const {
    DTRAIN_CHECK_ARG(n <= left(), what_, ": header ends inside ", field);
  }
  const std::string& what_;
  const std::string& bytes_;
  size_t pos_ = 0;
};

uint64_t get_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}
uint32_t get_u32(const unsigned char* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

uint64_t round_up(uint64_t n) { return (n + kDataAlignment - 1) / kDataAlignment * kDataAlignment; }

std::string shape_text(const std::vector<int64_t>& shape) {
  return "[" + detail::join(shape) + "]";
}

void check_name(const std::string& what, const std::string& name, const char* kind) {
  DTRAIN_CHECK_ARG(!name.empty(), what, ": a ", kind, " has an empty name");
  DTRAIN_CHECK_ARG(name.size() <= kMaxNameBytes, what, ": a ", kind, " name of ", name.size(),
                   " bytes (at most ", kMaxNameBytes, ")");
}

Entry read_entry(const std::string& what, Cursor& in) {
  Entry e;
  e.name = in.take_string("tensor name", kMaxNameBytes);
  check_name(what, e.name, "tensor");
  const uint8_t code = in.take<uint8_t>("dtype");
  DTRAIN_CHECK_ARG(code >= 1 && code <= kLastDType, what, ": tensor ", e.name,
                   " has the unknown dtype code ", int(code));
  e.dtype = static_cast<DType>(code);
  const uint8_t ndim = in.take<uint8_t>("rank");
  DTRAIN_CHECK_ARG(ndim <= kMaxDims, what, ": tensor ", e.name, " has ", int(ndim),
                   " dimensions (at most ", kMaxDims, ")");
  for (uint8_t d = 0; d < ndim; ++d) e.shape.push_back(in.take<int64_t>("shape"));
  e.offset = in.take<uint64_t>("offset");
  e.bytes = in.take<uint64_t>("size");
  e.crc = in.take<uint32_t>("checksum");
  return e;
}

Header parse_header(const std::string& what, const std::string& bytes, uint64_t data_bytes) {
  Cursor in(what, bytes);
  Header h;
  std::set<std::string> seen;
  const uint32_t pairs = in.take_count("metadata entries", 8);
  for (uint32_t i = 0; i < pairs; ++i) {
    auto key = in.take_string("metadata key", kMaxNameBytes);
    check_name(what, key, "metadata entry");
    DTRAIN_CHECK_ARG(seen.insert(key).second, what, ": metadata key ", key, " appears twice");
    auto value = in.take_string("metadata value", bytes.size());
    h.metadata.emplace_back(std::move(key), std::move(value));
  }
  seen.clear();
  // An entry is at least: name length + 1 byte of name, dtype, rank,
  // offset, size, checksum.
  const uint32_t count = in.take_count("tensors", 4 + 1 + 1 + 1 + 8 + 8 + 4);
  DTRAIN_CHECK_ARG(count <= kMaxTensors, what, ": ", count, " tensors (at most ", kMaxTensors,
                   ")");
  uint64_t next = 0;
  for (uint32_t i = 0; i < count; ++i) {
    Entry e = read_entry(what, in);
    DTRAIN_CHECK_ARG(seen.insert(e.name).second, what, ": tensor ", e.name, " appears twice");
    const uint64_t expected = tensor_bytes(what + ": tensor " + e.name, e.dtype, e.shape);
    DTRAIN_CHECK_ARG(e.bytes == expected, what, ": tensor ", e.name, " (", dtype_name(e.dtype),
                     " ", shape_text(e.shape), ") claims ", e.bytes, " bytes; its shape needs ",
                     expected);
    DTRAIN_CHECK_ARG(e.offset == next, what, ": tensor ", e.name, " starts at ", e.offset,
                     " in the data; the tensors before it end at ", next);
    DTRAIN_CHECK_ARG(e.bytes <= data_bytes - next, what, ": tensor ", e.name,
                     " ends past the data's ", data_bytes, " bytes");
    next += e.bytes;
    h.tensors.push_back(std::move(e));
  }
  DTRAIN_CHECK_ARG(in.left() == 0, what, ": ", in.left(), " unexpected bytes after the header");
  DTRAIN_CHECK_ARG(next == data_bytes, what, ": the tensors hold ", next,
                   " bytes; the data is ", data_bytes);
  return h;
}

}  // namespace

size_t element_size(DType type) { return kTypes[static_cast<uint8_t>(type)].size; }
const char* dtype_name(DType type) { return kTypes[static_cast<uint8_t>(type)].name; }

uint32_t crc32(const void* data, size_t bytes, uint32_t crc) {
  const auto* p = static_cast<const Bytef*>(data);
  while (bytes > 0) {  // zlib takes an unsigned count
    const auto chunk = static_cast<uInt>(std::min<size_t>(bytes, 1u << 30));
    crc = static_cast<uint32_t>(::crc32(crc, p, chunk));
    p += chunk;
    bytes -= chunk;
  }
  return crc;
}

uint64_t tensor_bytes(const std::string& what, DType type, const std::vector<int64_t>& shape) {
  uint64_t n = element_size(type);
  bool empty = false;
  for (int64_t d : shape) {
    DTRAIN_CHECK_ARG(d >= 0, what, " has the negative dimension ", d, " in ",
                     shape_text(shape));
    if (d == 0) empty = true;
  }
  if (empty) return 0;
  for (int64_t d : shape) {
    DTRAIN_CHECK_ARG(static_cast<uint64_t>(d) <= std::numeric_limits<uint64_t>::max() / n, what,
                     " has the shape ", shape_text(shape), ", too large to exist");
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

uint64_t assign_offsets(Header& header) {
  std::set<std::string> seen;
  for (const auto& [key, value] : header.metadata) {
    check_name("tensor file", key, "metadata entry");
    DTRAIN_CHECK_ARG(seen.insert(key).second, "tensor file: metadata key ", key,
                     " appears twice");
  }
  seen.clear();
  DTRAIN_CHECK_ARG(header.tensors.size() <= kMaxTensors, "tensor file: ", header.tensors.size(),
                   " tensors (at most ", kMaxTensors, ")");
  uint64_t next = 0;
  for (auto& e : header.tensors) {
    check_name("tensor file", e.name, "tensor");
    DTRAIN_CHECK_ARG(seen.insert(e.name).second, "tensor file: tensor ", e.name,
                     " appears twice");
    DTRAIN_CHECK_ARG(e.shape.size() <= kMaxDims, "tensor file: tensor ", e.name, " has ",
                     e.shape.size(), " dimensions (at most ", kMaxDims, ")");
    e.offset = next;
    next += e.bytes;
  }
  return next;
}

std::string encode_prefix(const Header& header, uint64_t data_bytes) {
  std::string body;
  put<uint32_t>(body, static_cast<uint32_t>(header.metadata.size()));
  for (const auto& [key, value] : header.metadata) {
    put_string(body, key);
    put_string(body, value);
  }
  put<uint32_t>(body, static_cast<uint32_t>(header.tensors.size()));
  for (const auto& e : header.tensors) {
    put_string(body, e.name);
    put<uint8_t>(body, static_cast<uint8_t>(e.dtype));
    put<uint8_t>(body, static_cast<uint8_t>(e.shape.size()));
    for (int64_t d : e.shape) put<int64_t>(body, d);
    put<uint64_t>(body, e.offset);
    put<uint64_t>(body, e.bytes);
    put<uint32_t>(body, e.crc);
  }
  DTRAIN_CHECK_ARG(body.size() <= kMaxHeaderBytes, "tensor file: the header would take ",
                   body.size(), " bytes (at most ", kMaxHeaderBytes,
                   "): too many tensors or too much metadata");
  std::string out(kMagic, sizeof(kMagic));
  put<uint32_t>(out, kVersion);
  put<uint32_t>(out, static_cast<uint32_t>(body.size()));
  put<uint64_t>(out, data_bytes);
  out += body;
  put<uint32_t>(out, crc32(out.data(), out.size()));
  out.resize(round_up(out.size()), '\0');
  return out;
}

Layout read_layout(const std::string& what, uint64_t file_size, const ReadAt& read) {
  DTRAIN_CHECK_ARG(file_size >= kPreambleBytes + 4, what, ": ", file_size,
                   " bytes, too short for a tensor file");
  unsigned char pre[kPreambleBytes];
  read(0, sizeof(pre), pre);
  DTRAIN_CHECK_ARG(std::memcmp(pre, kMagic, sizeof(kMagic)) == 0, what,
                   ": not a dtrain tensor file (it does not start with \"DTRNTENS\")");
  const uint32_t version = get_u32(pre + 8);
  DTRAIN_CHECK_ARG(version == kVersion, what, ": tensor file version ", version,
                   "; this dtrain reads version ", kVersion);
  const uint32_t header_bytes = get_u32(pre + 12);
  const uint64_t data_bytes = get_u64(pre + 16);
  DTRAIN_CHECK_ARG(header_bytes <= kMaxHeaderBytes, what, ": a header of ", header_bytes,
                   " bytes (at most ", kMaxHeaderBytes, ")");
  const uint64_t header_end = kPreambleBytes + uint64_t(header_bytes) + 4;
  DTRAIN_CHECK_ARG(header_end <= file_size, what, ": truncated: ", file_size,
                   " bytes, the header alone needs ", header_end);
  const uint64_t data_start = round_up(header_end);
  DTRAIN_CHECK_ARG(data_bytes <= std::numeric_limits<uint64_t>::max() - data_start &&
                       data_start + data_bytes == file_size,
                   what, ": ", data_start + data_bytes < file_size ? "has" : "truncated:", " ",
                   file_size, " bytes; its header describes ",
                   data_bytes <= std::numeric_limits<uint64_t>::max() - data_start
                       ? std::to_string(data_start + data_bytes)
                       : std::string("more than can exist"));

  // Preamble, header and CRC in one buffer: the CRC covers all but itself.
  std::string prefix(static_cast<size_t>(data_start), '\0');
  read(0, prefix.size(), prefix.data());
  const auto* raw = reinterpret_cast<const unsigned char*>(prefix.data());
  const uint32_t stored = get_u32(raw + header_end - 4);
  const uint32_t computed = crc32(raw, header_end - 4);
  DTRAIN_CHECK_ARG(stored == computed, what, ": the header is corrupt (checksum mismatch)");
  for (uint64_t i = header_end; i < data_start; ++i)
    DTRAIN_CHECK_ARG(raw[i] == 0, what, ": nonzero padding before the data");

  Layout layout;
  layout.header = parse_header(what, prefix.substr(kPreambleBytes, header_bytes), data_bytes);
  layout.data_start = data_start;
  layout.data_bytes = data_bytes;
  return layout;
}

void verify(const std::string& what, const Entry& entry, const void* data) {
  const uint32_t computed = crc32(data, static_cast<size_t>(entry.bytes));
  DTRAIN_CHECK_ARG(computed == entry.crc, what, ": tensor ", entry.name,
                   " is corrupt (checksum mismatch)");
}

}  // namespace dtrain::tensor_file
