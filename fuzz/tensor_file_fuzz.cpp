// libFuzzer harness: the tensor file reader (the checkpoint format) on a
// file it did not write. Each input is a whole file. The harness reads its
// layout as load_tensor_file does, verifies every tensor's checksum against
// its bytes, and checks that a header it accepted encodes back to exactly
// the bytes it was read from. A refused file is an InvalidArgument naming
// the problem; a crash, a sanitizer report, an allocation larger than the
// input allows or a header that does not round-trip is a bug.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "checkpoint/tensor_file_format.h"
#include "dtrain/errors.h"

namespace tf = dtrain::tensor_file;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto read = [&](uint64_t offset, size_t n, void* out) {
    if (offset > size || n > size - offset) throw dtrain::InvalidArgument("read past the end");
    std::memcpy(out, data + offset, n);
  };
  tf::Layout layout;
  try {
    layout = tf::read_layout("fuzz", size, read);
  } catch (const dtrain::InvalidArgument&) {
    return 0;  // refused with a message: the expected outcome for most inputs
  }
  if (layout.data_start + layout.data_bytes != size) std::abort();
  for (const auto& e : layout.header.tensors) {
    if (e.offset + e.bytes > layout.data_bytes) std::abort();
    try {
      tf::verify("fuzz", e, data + layout.data_start + e.offset);
    } catch (const dtrain::InvalidArgument&) {
    }
  }
  const std::string again = tf::encode_prefix(layout.header, layout.data_bytes);
  if (again.size() != layout.data_start || std::memcmp(again.data(), data, again.size()) != 0)
    std::abort();
  return 0;
}
