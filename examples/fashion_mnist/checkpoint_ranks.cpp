// What the ranks of the example decide together: whether to resume, and
// whether any of them failed.

#include <cstring>
#include <dtrain/errors.h>
#include <dtrain/objects.h>
#include <unistd.h>

#include <optional>
#include <stdexcept>

#include "checkpoint.h"

bool any_rank_has_checkpoint(dtrain::ProcessGroup& group, const std::string& dir) {
  const int64_t mine = ::access((dir + "/metadata.dtt").c_str(), R_OK) == 0;
  auto found = torch::tensor({mine}).to(group.control_device());
  group.all_reduce(found, dtrain::ReduceOp::MAX)->wait();
  return found.cpu().item<int64_t>() != 0;
}

void save_checkpoint(const std::shared_ptr<dtrain::ProcessGroup>& group, const std::string& dir,
                     torch::nn::Module& model, torch::optim::Adam& opt, const TrainingState& state,
                     const CheckpointFaults& faults) {
  auto contents = checkpoint_contents(model, opt);
  contents.metadata = checkpoint_metadata(model, opt, state);
  try {
    dtrain::checkpoint::save(dir, contents,
                             dtrain::checkpoint::SaveOptions().process_group(group).faults(faults));
  } catch (const dtrain::Error& e) {
    // "checkpoint::save <dir>: rank <r>: ..." -> "cannot save checkpoint <dir>: rank <r>: ..."
    const std::string prefix = "checkpoint::save " + dir + ": ";
    std::string what = e.what();
    if (what.compare(0, prefix.size(), prefix) == 0) what.erase(0, prefix.size());
    throw std::runtime_error("cannot save checkpoint " + dir + ": " + what);
  }
}

TrainingState load_checkpoint(const std::shared_ptr<dtrain::ProcessGroup>& group,
                              const std::string& dir, torch::nn::Module& model,
                              torch::optim::Adam& opt, int64_t dataset_size) {
  std::optional<Checkpoint> checkpoint;
  std::string error;
  try {
    checkpoint.emplace(read_checkpoint(dir, model, opt, dataset_size));
  } catch (const std::exception& e) {
    error = e.what();
  }
  dtrain::fail_together(*group, error);  // no rank installs what another could not read
  checkpoint->apply(model, opt);
  return checkpoint->state();
}
