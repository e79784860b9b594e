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

#include "sealed_tensor_file.h"
#include "dtrain/errors.h"
#include "fashion_mnist/checkpoint.h"

namespace {

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
  const std::string file = fuzz::sealed(data, size);
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
