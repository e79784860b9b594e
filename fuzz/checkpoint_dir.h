#pragma once

// For the harnesses that load a distributed checkpoint directory: an input
// of two tensor files — a 4-byte little-endian length, the metadata file,
// then rank 0's data file — written (sealed, see sealed_tensor_file.h) into
// a scratch directory of this process. The data file is named after the
// token the metadata names when that is a valid one.

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "dtrain/checkpoint/tensor_file.h"
#include "dtrain/errors.h"
#include "sealed_tensor_file.h"

namespace fuzz {

inline const std::string& checkpoint_directory() {
  static const std::string dir = [] {
    char tmpl[] = "/tmp/dtrain-fuzz-ckpt-XXXXXX";
    if (!mkdtemp(tmpl)) std::abort();
    return std::string(tmpl);
  }();
  return dir;
}

inline void write_file(const std::string& path, const std::string& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
}

// The token metadata.dtt names, if it parses and the token is well formed.
inline std::string token_of(const std::string& metadata_path) {
  try {
    dtrain::checkpoint::TensorFileReader reader(metadata_path);
    auto it = reader.metadata().find("token");
    if (it != reader.metadata().end() && it->second.size() == 16 &&
        it->second.find_first_not_of("0123456789abcdef") == std::string::npos)
      return it->second;
  } catch (const dtrain::InvalidArgument&) {
  }
  return "0000000000000000";
}

// Writes the input's two files; returns the data file's path ("" when the
// input is too short to hold the length).
inline std::string write_checkpoint(const uint8_t* data, size_t size) {
  if (size < 4) return "";
  uint32_t split;
  std::memcpy(&split, data, 4);
  data += 4, size -= 4;
  if (split > size) split = static_cast<uint32_t>(size);
  const std::string& dir = checkpoint_directory();
  const std::string metadata = dir + "/metadata.dtt";
  write_file(metadata, sealed(data, split));
  const std::string data_file = dir + "/data-" + token_of(metadata) + "-0.dtt";
  write_file(data_file, sealed(data + split, size - split));
  return data_file;
}

}  // namespace fuzz
