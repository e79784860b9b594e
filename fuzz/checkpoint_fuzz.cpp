// libFuzzer harness: the training example's checkpoint loader
// (read_checkpoint, then apply when it accepts) on a checkpoint directory it
// did not write, for a small model (fc: Linear(3, 2)) and its Adam. Each
// input is the metadata file and rank 0's data file, as checkpoint_dir.h
// writes them (checksums made right, so that mutations reach the checks
// behind them). A refused checkpoint is a std::runtime_error naming the problem; a
// crash, a sanitizer report or an allocation beyond the input's size is a
// bug. Seeds: fuzz/make_seeds.py (valid checkpoints of this model).

#include <torch/torch.h>
#include <unistd.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "checkpoint_dir.h"
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
  const std::string data_file = fuzz::write_checkpoint(data, size);
  if (data_file.empty()) return 0;
  const std::string& dir = fuzz::checkpoint_directory();
  try {
    Checkpoint c = read_checkpoint(dir, *model, opt, /*dataset_size=*/100);
    c.apply(*model, opt);
  } catch (const std::runtime_error&) {
    // Refused with a message: the expected outcome for most inputs.
  }
  ::unlink(data_file.c_str());
  return 0;
}
