// libFuzzer harness: the training example's checkpoint loader
// (read_checkpoint, then apply when it accepts) on a checkpoint directory it
// did not write, for a small model (fc: Linear(3, 2)) and its Adam. Each
// input is two tensor files: a 4-byte little-endian length, the metadata
// file, then rank 0's data file (both sealed: their checksums made right, see
// sealed_tensor_file.h, so that mutations reach the checks behind them). The
// data file is named after the token the metadata names when that is a valid
// one. A refused checkpoint is a std::runtime_error naming the problem; a
// crash, a sanitizer report or an allocation beyond the input's size is a
// bug. Seeds: fuzz/make_seeds.py (valid checkpoints of this model).

#include <torch/torch.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "dtrain/errors.h"
#include "fashion_mnist/checkpoint.h"
#include "sealed_tensor_file.h"

namespace {

struct TinyImpl : torch::nn::Module {
  TinyImpl() { fc = register_module("fc", torch::nn::Linear(3, 2)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Tiny);

const std::string& directory() {
  static const std::string dir = [] {
    char tmpl[] = "/tmp/dtrain-fuzz-example-ckpt-XXXXXX";
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
  static Tiny model;
  static torch::optim::Adam opt(model->parameters());
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
  try {
    Checkpoint c = read_checkpoint(dir, *model, opt, /*dataset_size=*/100);
    c.apply(*model, opt);
  } catch (const std::runtime_error&) {
    // Refused with a message: the expected outcome for most inputs.
  }
  ::unlink(data_file.c_str());
  return 0;
}
