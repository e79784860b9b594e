// The collective forms of checkpoint.h: a failure on any rank reaches
// every rank at once.

#include <cstring>
#include <optional>
#include <stdexcept>

#include "checkpoint.h"

// --- the collective forms ---------------------------------------------------

// Two collectives when all succeeded (one all_reduce), four otherwise: the
// lowest failing rank is found with MIN, then broadcasts its message.
void fail_together(dtrain::ProcessGroup& group, const std::string& error) {
  const int64_t none = group.size();
  // On the group's control device (the GPU under nccl), read back on the host.
  const auto on = group.control_device();
  auto first = torch::tensor({error.empty() ? none : static_cast<int64_t>(group.rank())}).to(on);
  group.all_reduce(first, dtrain::ReduceOp::MIN)->wait();
  const int64_t failed = first.item<int64_t>();
  if (failed == none) return;
  const int root = static_cast<int>(failed);
  auto length = torch::tensor({static_cast<int64_t>(error.size())}).to(on);
  group.broadcast(length, root)->wait();
  auto text = torch::zeros({length.item<int64_t>()}, torch::kUInt8);
  if (group.rank() == root) std::memcpy(text.data_ptr(), error.data(), error.size());
  text = text.to(on);
  group.broadcast(text, root)->wait();
  text = text.cpu();
  const auto* chars = static_cast<const char*>(text.data_ptr());
  throw std::runtime_error("rank " + std::to_string(root) + ": " +
                           std::string(chars, chars + text.numel()));
}

void save_checkpoint_from_rank0(dtrain::ProcessGroup& group, const std::string& path,
                                torch::nn::Module& model, const torch::optim::Adam& opt,
                                const TrainingState& state, const CheckpointFaults& faults) {
  std::string error;
  if (group.rank() == 0) {
    try {
      save_checkpoint(path, model, opt, state, faults);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  fail_together(group, error);  // also keeps every rank behind the checkpoint
}

TrainingState load_checkpoint_on_all_ranks(dtrain::ProcessGroup& group, const std::string& path,
                                           torch::nn::Module& model, torch::optim::Adam& opt) {
  std::optional<Checkpoint> checkpoint;
  std::string error;
  try {
    checkpoint.emplace(read_checkpoint(path, model, opt));
  } catch (const std::exception& e) {
    error = e.what();
  }
  fail_together(group, error);
  try {
    checkpoint->apply(model, opt);
  } catch (const std::exception& e) {
    error = e.what();
  }
  fail_together(group, error);  // no rank trains on when another could not apply it
  return checkpoint->state();
}
