// libFuzzer harness: the tensor file reader (the checkpoint format) on a
// file it did not write. Each input is a whole file, read twice: as it is,
// and with its header CRC recomputed (so that mutations reach the header
// parser behind the checksum). Each time the harness reads the layout as
// load_tensor_file does, verifies every tensor's checksum against its
// bytes, and checks that a header it accepted encodes back to exactly the
// bytes it was read from. A refused file is an InvalidArgument naming
// the problem; a crash, a sanitizer report, an allocation larger than the
// input allows or a header that does not round-trip is a bug.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "checkpoint/formats/tensor_file_format.h"
#include "dtrain/errors.h"

namespace tf = dtrain::tensor_file;

namespace {

void read_file(const uint8_t* data, size_t size) {
  auto read = [&](uint64_t offset, size_t n, void* out) {
    if (offset > size || n > size - offset) throw dtrain::InvalidArgument("read past the end");
    std::memcpy(out, data + offset, n);
  };
  tf::Layout layout;
  try {
    layout = tf::read_layout("fuzz", size, read);
  } catch (const dtrain::InvalidArgument&) {
    return;  // refused with a message: the expected outcome for most inputs
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
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  read_file(data, size);
  if (size < tf::kPreambleBytes + 4) return 0;
  uint32_t header_bytes;
  std::memcpy(&header_bytes, data + 12, 4);
  if (header_bytes > size - tf::kPreambleBytes - 4) return 0;
  std::vector<uint8_t> sealed(data, data + size);
  const size_t end = tf::kPreambleBytes + header_bytes;
  const uint32_t crc = tf::crc32(sealed.data(), end);
  std::memcpy(&sealed[end], &crc, 4);
  read_file(sealed.data(), sealed.size());
  return 0;
}
