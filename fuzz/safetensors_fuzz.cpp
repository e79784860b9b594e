// libFuzzer harness: the safetensors header reader (Hugging Face's format,
// src/checkpoint/formats/safetensors_format.h) on files it did not write. Each
// input is a whole file. A file it accepts must hold every tensor inside
// its data, packed without holes or overlaps, and its header must encode
// back to a file the reader accepts with the same tensors. A refused file
// is an InvalidArgument naming the problem; a crash, a sanitizer report or
// an accepted file that breaks those rules is a bug.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "checkpoint/formats/safetensors_format.h"
#include "dtrain/errors.h"

namespace st = dtrain::safetensors;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto read = [&](uint64_t offset, size_t n, void* out) {
    if (offset > size || n > size - offset) throw dtrain::InvalidArgument("read past the end");
    std::memcpy(out, data + offset, n);
  };
  st::Layout layout;
  try {
    layout = st::read_layout("fuzz", size, read);
  } catch (const dtrain::InvalidArgument&) {
    return 0;
  }
  if (layout.data_start + layout.data_bytes != size) std::abort();
  uint64_t total = 0;
  for (const auto& e : layout.tensors) {
    if (e.end < e.begin || e.end > layout.data_bytes) std::abort();
    total += e.end - e.begin;
  }
  if (total != layout.data_bytes) std::abort();
  // Encoded again (packed in the header's order), it reads back alike.
  auto tensors = layout.tensors;
  const std::string prefix = st::encode_prefix(tensors, layout.metadata);
  const std::string file = prefix + std::string(static_cast<size_t>(total), '\0');
  auto reread = [&](uint64_t offset, size_t n, void* out) { std::memcpy(out, file.data() + offset, n); };
  const auto again = st::read_layout("fuzz again", file.size(), reread);
  if (again.tensors.size() != layout.tensors.size() || again.metadata != layout.metadata) std::abort();
  for (size_t i = 0; i < again.tensors.size(); ++i)
    if (again.tensors[i].name != layout.tensors[i].name || again.tensors[i].shape != layout.tensors[i].shape ||
        again.tensors[i].dtype != layout.tensors[i].dtype)
      std::abort();
  return 0;
}
