// libFuzzer harness: the training example's checkpoint loader
// (read_checkpoint, then apply when it accepts) on a file it did not
// write, for a small model (fc: Linear(3, 2)) and its Adam. Each input is
// the whole file; when its layout parses, the harness first makes its
// header and tensor checksums right, so that mutations reach the checks
// behind them (tensor_file_fuzz covers the checksums themselves). A refused file is a std::runtime_error naming the
// problem; a crash, a sanitizer report or an allocation beyond the input's
// size is a bug. Seeds: fuzz/make_seeds.py (valid checkpoints of this model).

#include <torch/torch.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include "checkpoint/tensor_file_format.h"
#include "dtrain/errors.h"
#include "fashion_mnist/checkpoint.h"

namespace {

namespace tf = dtrain::tensor_file;

// The input with every checksum recomputed, or as it is when its layout
// does not parse.
std::string sealed(const uint8_t* data, size_t size) {
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

struct TinyImpl : torch::nn::Module {
  TinyImpl() { fc = register_module("fc", torch::nn::Linear(3, 2)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Tiny);

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Tiny model;
  static torch::optim::Adam opt(model->parameters());
  static const std::string path = "/dev/shm/dtrain-checkpoint-fuzz-" + std::to_string(getpid());
  const std::string file = sealed(data, size);
  if (FILE* f = std::fopen(path.c_str(), "wb")) {
    std::fwrite(file.data(), 1, file.size(), f);
    std::fclose(f);
  }
  try {
    Checkpoint c = read_checkpoint(path, *model, opt);
    c.apply(*model, opt);
  } catch (const std::runtime_error&) {
    // Refused with a message: the expected outcome for most inputs.
  }
  ::unlink(path.c_str());
  return 0;
}
