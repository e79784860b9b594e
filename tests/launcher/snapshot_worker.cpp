// A training job for the snapshot test (netns_snapshot_test.sh), run by
// dtrain-run: an MLP under FSDP with Adam on the tcp backend (whose sums
// depend on the ranks' numbers only, not on which host holds them), an
// asynchronous snapshot in memory every EVERY steps and a checkpoint on disk every
// DISK_EVERY steps. On start it resumes from the newer of the two.
//   snapshot_worker STEPS EVERY DISK_EVERY DIR SLEEP_MS
// Prints "resumed from snapshot S", "resumed from disk S" or "fresh start",
// then per step "step S rank R attempt A state <crc> loss <loss>" (the CRC
// of every byte of this rank's state after the step: equal lines mean
// bitwise equal training; A is dtrain-run's restart count).
// With CRASH_AT, the last rank exits (9) after that step on the first attempt.

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <string>
#include <thread>

#include "dtrain/checkpoint/snapshot.h"
#include "dtrain/dtrain.h"

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    a = register_module("a", torch::nn::Linear(16, 64));
    b = register_module("b", torch::nn::Linear(64, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return b(torch::tanh(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Mlp);

uint32_t crc_of(const dtrain::checkpoint::DistributedState& state) {
  uint32_t crc = 0xffffffffu;
  auto feed = [&](const at::Tensor& t) {
    auto c = t.detach().contiguous();
    const auto* p = static_cast<const uint8_t*>(c.data_ptr());
    for (size_t i = 0; i < c.nbytes(); ++i) {
      crc ^= p[i];
      for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1u)));
    }
  };
  for (const auto& [name, t] : state.replicated) feed(t);
  for (const auto& [name, s] : state.sharded) feed(s.local);
  return ~crc;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6 && argc != 7) {
    std::fprintf(stderr, "usage: snapshot_worker STEPS EVERY DISK_EVERY DIR SLEEP_MS [CRASH_AT]\n");
    return 2;
  }
  const int64_t steps = std::stoll(argv[1]), every = std::stoll(argv[2]), disk_every = std::stoll(argv[3]);
  const std::string dir = argv[4];
  const int sleep_ms = std::stoi(argv[5]);
  const int64_t crash_at = argc == 7 ? std::stoll(argv[6]) : -1;
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const bool first_attempt = !restarts || std::string(restarts) == "0";
  dtrain::init_process_group(dtrain::InitOptions().backend("tcp"));
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  torch::manual_seed(7);
  auto fsdp = std::make_shared<dtrain::FullyShardedDataParallel<MlpImpl>>(Mlp().ptr());
  torch::optim::Adam adam(fsdp->parameters(), torch::optim::AdamOptions(1e-2));
  dtrain::checkpoint::DistributedState state;
  dtrain::checkpoint::add_fsdp(state, *fsdp, adam);

  int64_t on_disk = -1;
  try {
    dtrain::checkpoint::inspect(dir);
    dtrain::checkpoint::load(dir, state);
    on_disk = std::stoll(state.metadata.at("step"));
  } catch (const dtrain::InvalidArgument&) {
    // no checkpoint on disk yet
  }
  int64_t start = on_disk + 1;
  if (auto step = dtrain::checkpoint::restore_snapshot(state, on_disk)) {
    start = *step + 1;
    if (rank == 0) std::printf("resumed from snapshot %lld\n", static_cast<long long>(*step));
  } else if (rank == 0) {
    std::printf(on_disk >= 0 ? "resumed from disk %lld\n" : "fresh start\n", static_cast<long long>(on_disk));
  }
  std::fflush(stdout);
  dtrain::checkpoint::AsyncSnapshot pending;
  for (int64_t step = start; step < steps; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + rank);
    auto x = at::randn({8, 16}, gen), y = at::randn({8, 4}, gen);
    adam.zero_grad();
    auto loss = torch::mse_loss(fsdp->forward(x), y);
    loss.backward();
    adam.step();
    std::printf("step %lld rank %d attempt %s state %08x loss %a\n", static_cast<long long>(step), rank,
                restarts ? restarts : "0", crc_of(state), loss.item<double>());
    std::fflush(stdout);
    state.metadata["step"] = std::to_string(step);
    if (step % every == 0) pending = dtrain::checkpoint::async_snapshot(step, state);
    if (step % disk_every == 0) dtrain::checkpoint::save(dir, state);
    if (step == crash_at && first_attempt && rank == world - 1) std::_Exit(9);
    std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
  }
  if (pending.valid()) pending.wait();
  dtrain::destroy_process_group();
  return 0;
}
