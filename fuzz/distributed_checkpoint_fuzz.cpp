// libFuzzer harness: dtrain::checkpoint::load on a checkpoint directory it
// did not write. Each input is two tensor files: a 4-byte little-endian
// length, the metadata file, then rank 0's data file (both sealed: their
// checksums made right, see sealed_tensor_file.h). The data file is named
// after the token the metadata names when that is a valid one. The state
// asks for a replicated float [2, 3] "param/w", a sharded 10-element "s"
// (a flat range) and rows [2, 4) of a float [4, 3] "b" (a box); a refused
// checkpoint is an InvalidArgument naming the problem, a
// crash or a sanitizer report is a bug. Seeds: fuzz/make_seeds.py.

#include <torch/torch.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include "checkpoint_dir.h"
#include "dtrain/checkpoint/distributed.h"
#include "dtrain/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string data_file = fuzz::write_checkpoint(data, size);
  if (data_file.empty()) return 0;
  const std::string& dir = fuzz::checkpoint_directory();
  dtrain::checkpoint::DistributedState state;
  state.replicated["param/w"] = torch::zeros({2, 3});
  state.sharded["s"] = dtrain::checkpoint::ShardedTensor{torch::zeros({10}), 0, 10};
  state.sharded["b"] = dtrain::checkpoint::ShardedTensor::box(torch::zeros({2, 3}), {4, 3}, {2, 0});
  try {
    dtrain::checkpoint::load(dir, state);
  } catch (const dtrain::InvalidArgument&) {
  }
  ::unlink(data_file.c_str());
  return 0;
}
