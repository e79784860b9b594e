#pragma once

// For the harnesses that read tensor files through checks behind their
// checksums: the input with its header CRC and every tensor's CRC made
// right, so that mutations reach what lies behind them (tensor_file_fuzz
// covers the checksums themselves).

#include <cstdint>
#include <cstring>
#include <string>

#include "checkpoint/formats/tensor_file_format.h"
#include "dtrain/errors.h"

namespace fuzz {

namespace tf = dtrain::tensor_file;

// The input with every checksum recomputed, or as it is when its layout
// does not parse.
inline std::string sealed(const uint8_t* data, size_t size) {
  std::string file(reinterpret_cast<const char*>(data), size);
  if (size < tf::kPreambleBytes + 4) return file;
  uint32_t header_bytes;
  std::memcpy(&header_bytes, data + 12, 4);
  if (header_bytes > size - tf::kPreambleBytes - 4) return file;
  const size_t end = tf::kPreambleBytes + header_bytes;
  const uint32_t crc = tf::crc32(file.data(), end);
  std::memcpy(&file[end], &crc, 4);
  try {
    tf::Layout l = tf::read_layout("fuzz", file.size(), [&](uint64_t at, size_t n, void* out) {
      std::memcpy(out, file.data() + at, n);
    });
    for (auto& e : l.header.tensors)
      e.crc = tf::crc32(file.data() + l.data_start + e.offset, e.bytes);
    return tf::encode_prefix(l.header, l.data_bytes) + file.substr(l.data_start);
  } catch (const dtrain::InvalidArgument&) {
    return file;
  }
}

}  // namespace fuzz
