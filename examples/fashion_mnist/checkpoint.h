#pragma once

// The training example's checkpoints: dtrain's distributed checkpoints
// (dtrain/checkpoint/distributed.h, docs/checkpoint.md), so a job resumes
// at any number of ranks.
//
// A checkpoint is a directory. Every rank writes its share of the model's
// parameters and buffers ("model/param/<name>", "model/buffer/<name>"),
// Adam's state ("optimizer/optim/<name>/exp_avg|exp_avg_sq|max_exp_avg_sq|
// step") and the CPU RNG state ("rng") to its own tensor file; rank 0 then
// commits them with the metadata file, written atomically (temporary file,
// fsync, rename, fsync of the directory), which also holds the counters,
// Adam's options and the model's layout. A crash at any point leaves the
// previous checkpoint loadable. The files are validated tensor files: nothing
// in them is unpickled or run. Every rank must see the same directory (one
// machine, or a shared filesystem across machines).
//
// Loading reads and checks everything first on every rank (the program and
// the model it was written for, each tensor's name, dtype and shape, no
// entry missing or unexpected, the counters against the dataset, Adam's
// options and step counts, the RNG state); only when every rank succeeded
// does any rank install it, so a failure on one rank stops all of them with
// its error and nobody trains on a half-installed state.

#include <dtrain/checkpoint/distributed.h>
#include <dtrain/checkpoint/tensor_file.h>
#include <dtrain/process_group.h>
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

struct TrainingState {
  int64_t epoch = 0;             // epoch in progress
  int64_t samples_in_epoch = 0;  // of that epoch's global order, trained on by all ranks together
  int64_t global_step = 0;       // optimizer steps so far
  int64_t world_size = 1;        // of the job that wrote it
};

// Test hooks: this rank's write SIGKILLs itself half way, or its fsync fails.
using CheckpointFaults = dtrain::checkpoint::WriteFaults;

// --- one rank (checkpoint.cpp) --------------------------------------------

// What a checkpoint holds: views of the model's and Adam's tensors (Adam's
// state is created, as zeros, where it has none) and a copy of the RNG
// state; and the metadata describing them.
dtrain::checkpoint::DistributedState checkpoint_contents(torch::nn::Module& model,
                                                         torch::optim::Adam& opt);
std::map<std::string, std::string> checkpoint_metadata(torch::nn::Module& model,
                                                       torch::optim::Adam& opt,
                                                       const TrainingState& state);

// A checkpoint read in full and checked against a model and an optimizer.
class Checkpoint {
 public:
  const TrainingState& state() const { return state_; }
  // Installs the model tensors, Adam's state and options, and the CPU RNG
  // state. Only for the model and optimizer it was read against; then
  // nothing in it can fail but memory allocation.
  void apply(torch::nn::Module& model, torch::optim::Adam& opt);

 private:
  friend Checkpoint read_checkpoint(const std::string&, torch::nn::Module&, torch::optim::Adam&,
                                    int64_t);
  Checkpoint() = default;

  TrainingState state_;
  torch::optim::AdamOptions options_;
  dtrain::checkpoint::DistributedState staged_;  // read and checked
};

// Reads the checkpoint in `dir` (written by any number of ranks) for a
// dataset of `dataset_size` samples. Throws std::runtime_error "cannot load
// checkpoint <dir>: <why>" (missing, truncated or corrupt, another program's
// or another model's, a tensor of the wrong dtype or shape, an entry
// missing or unexpected, impossible counters or options, a bad RNG state).
// Changes neither `model` nor `opt`'s values.
Checkpoint read_checkpoint(const std::string& dir, torch::nn::Module& model, torch::optim::Adam& opt,
                           int64_t dataset_size);

// --- the ranks together (checkpoint_ranks.cpp) -----------------------------

// Collective over `group`. Throws std::runtime_error "cannot save checkpoint
// <dir>: rank <r>: <why>" on every rank when any rank cannot write; the
// previous checkpoint in `dir` is then still the one that loads.
void save_checkpoint(const std::shared_ptr<dtrain::ProcessGroup>& group, const std::string& dir,
                     torch::nn::Module& model, torch::optim::Adam& opt, const TrainingState& state,
                     const CheckpointFaults& faults = {});

// Collective over `group`: the checkpoint in `dir` (written by any number of
// ranks) for a dataset of `dataset_size` samples. When any rank cannot read
// or accept it, every rank throws std::runtime_error "rank <r>: cannot load
// checkpoint <dir>: <why>" (r the lowest failing rank) with the model, the
// optimizer and the RNG unchanged.
TrainingState load_checkpoint(const std::shared_ptr<dtrain::ProcessGroup>& group,
                              const std::string& dir, torch::nn::Module& model,
                              torch::optim::Adam& opt, int64_t dataset_size);

// Collective: whether any rank sees a committed checkpoint in `dir`. The
// ranks decide together whether to resume; a rank that lacks it then fails
// the load on every rank instead of training from scratch beside the others.
bool any_rank_has_checkpoint(dtrain::ProcessGroup& group, const std::string& dir);

// Adam's state of `param`, or null when it has none (never stepped).
// Works with libtorch 1.x's and 2.x's keys of Optimizer::state().
const torch::optim::AdamParamState* adam_state(const torch::optim::Adam& opt,
                                               const torch::Tensor& param);
