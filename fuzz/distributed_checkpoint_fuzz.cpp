// libFuzzer harness: dtrain::checkpoint::load on a checkpoint directory it
// did not write. Each input is two tensor files: a 4-byte little-endian
// length, the metadata file, then rank 0's data file (both sealed: their
// checksums made right, see sealed_tensor_file.h). The data file is named
// after the token the metadata names when that is a valid one. The state
// asks for a replicated float [2, 3] "param/w" and a sharded 10-element
// "s"; a refused checkpoint is an InvalidArgument naming the problem, a
// crash or a sanitizer report is a bug. Seeds: fuzz/make_seeds.py.

#include <torch/torch.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "dtrain/checkpoint/distributed.h"
#include "dtrain/errors.h"
#include "sealed_tensor_file.h"

namespace {

const std::string& directory() {
  static const std::string dir = [] {
    char tmpl[] = "/tmp/dtrain-fuzz-ckpt-XXXXXX";
    if (!mkdtemp(tmpl)) std::abort();
    return std::string(tmpl);
  }();
  return dir;
}

void write(const std::string& path, const std::string& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
}

// The token metadata.dtt names, if it parses and the token is well formed.
std::string token_of(const std::string& metadata_path) {
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

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  uint32_t split;
  std::memcpy(&split, data, 4);
  data += 4, size -= 4;
  if (split > size) split = static_cast<uint32_t>(size);
  const std::string dir = directory();
  const std::string metadata = dir + "/metadata.dtt";
  write(metadata, fuzz::sealed(data, split));
  const std::string data_file = dir + "/data-" + token_of(metadata) + "-0.dtt";
  write(data_file, fuzz::sealed(data + split, size - split));
  dtrain::checkpoint::DistributedState state;
  state.replicated["param/w"] = torch::zeros({2, 3});
  state.sharded["s"] = dtrain::checkpoint::ShardedTensor{torch::zeros({10}), 0, 10};
  try {
    dtrain::checkpoint::load(dir, state);
  } catch (const dtrain::InvalidArgument&) {
  }
  ::unlink(data_file.c_str());
  return 0;
}
