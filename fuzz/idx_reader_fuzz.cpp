// libFuzzer harness: the IDX/gzip dataset reader on a file it did not
// write. The first input byte picks what the reader expects (labels or
// images, 1 to 4 items of a few sizes); the rest is the file, gzip or raw
// (zlib reads both). A file that does not match is an InvalidArgument
// naming the problem; a crash, a sanitizer report, a read outside the
// buffer the reader was given or a buffer of the wrong size is a bug.

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "data/idx_reader.h"
#include "dtrain/errors.h"

using dtrain::data::IdxSpec;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t pick = data[0];
  IdxSpec spec;
  spec.count = 1 + (pick & 3);
  if (pick & 4) {
    spec.magic = dtrain::data::kIdxImagesMagic;
    spec.item_name = "images";
    spec.item_dims = (pick & 8) ? std::vector<int64_t>{28, 28} : std::vector<int64_t>{2, 3};
  } else {
    spec.magic = dtrain::data::kIdxLabelsMagic;
    spec.item_name = "labels";
  }
  static const int fd = memfd_create("idx-fuzz", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, 0) != 0 || pwrite(fd, data + 1, size - 1, 0) != ssize_t(size - 1))
    std::abort();
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  std::vector<uint8_t> buffer;
  try {
    dtrain::data::read_idx_gz(path, spec, [&](const std::vector<int64_t>& shape) {
      size_t n = 1;
      for (int64_t d : shape) n *= static_cast<size_t>(d);
      if (shape.size() != 1 + spec.item_dims.size() || shape[0] != spec.count) std::abort();
      buffer.assign(n, 0);
      return buffer.data();
    });
  } catch (const dtrain::InvalidArgument&) {
  }
  return 0;
}
