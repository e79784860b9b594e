#pragma once

// Checkpoints that survive crashes and refuse damage.
//
// The file is a dtrain tensor file (dtrain/checkpoint/tensor_file.h): named
// tensors and metadata behind a validated header, with a checksum per
// tensor; nothing in it is unpickled or run. It holds the model's
// parameters and buffers ("model/<name>"), Adam's state per parameter
// index ("optimizer/state/<k>/step|exp_avg|exp_avg_sq|max_exp_avg_sq") and
// per group ("optimizer/group/<g>/options": lr, beta1, beta2, eps,
// weight_decay, amsgrad), the counters ("state/epoch", ...) and the CPU RNG
// state ("rng").
//
// Saving: rank 0 writes to `<path>.tmp` in the same directory, fsyncs it,
// renames it over `<path>` and fsyncs the directory, checking each step, so
// the file under the final name is always a complete checkpoint (the
// previous one until the rename). On any failure the temporary file is
// removed and the error names the file and the step that failed.
//
// Loading happens in two phases: read_checkpoint() reads the whole file and
// validates everything in it against the model and the optimizer (every
// model tensor's name, dtype and shape, the optimizer state, the epoch and
// step counters, the RNG state; nothing unexpected) without modifying
// either; only then does Checkpoint::apply() install it.
//
// In a job, every rank calls the collective forms (save_checkpoint_from_rank0,
// load_checkpoint_on_all_ranks): a failure on any rank reaches every rank at
// once, and all of them throw the same error instead of some training on or
// waiting for a peer that gave up.

#include <dtrain/checkpoint/tensor_file.h>
#include <dtrain/process_group.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>

struct TrainingState {
  int64_t epoch = 0;            // epoch in progress
  int64_t step_in_epoch = 0;    // batches of that epoch already trained
  int64_t global_step = 0;
  int64_t world_size = 1;
};

// Test hooks: the writer SIGKILLs itself half way, or its fsync fails.
using CheckpointFaults = dtrain::checkpoint::WriteFaults;

// What a checkpoint file holds, as save_checkpoint builds it (the tests
// damage one entry of it at a time).
dtrain::checkpoint::TensorFile checkpoint_contents(torch::nn::Module& model,
                                                   const torch::optim::Adam& opt,
                                                   const TrainingState& state);

// Throws std::runtime_error "cannot save checkpoint <path>: ..." naming the
// file and the step that failed; `<path>` is then untouched.
void save_checkpoint(const std::string& path, torch::nn::Module& model, const torch::optim::Adam& opt,
                     const TrainingState& state, const CheckpointFaults& faults = {});

// Adam's state of `param`, or null when it has none (never stepped).
// Works with libtorch 1.x's and 2.x's keys of Optimizer::state().
const torch::optim::AdamParamState* adam_state(const torch::optim::Adam& opt,
                                               const torch::Tensor& param);

// A checkpoint read in full and validated against a model and an optimizer.
class Checkpoint {
 public:
  const TrainingState& state() const { return state_; }
  // Installs the model tensors, the optimizer state and the CPU RNG state.
  // Only for the model and optimizer it was validated against; then nothing
  // in it can fail but memory allocation.
  void apply(torch::nn::Module& model, torch::optim::Adam& opt);

 private:
  friend Checkpoint read_checkpoint(const std::string&, torch::nn::Module&,
                                    const torch::optim::Adam&);
  Checkpoint() = default;

  std::string path_;
  TrainingState state_;
  dtrain::checkpoint::TensorFile file_;  // validated
};

// Throws std::runtime_error "checkpoint <path> ..." naming the problem
// (missing, truncated or corrupt, written for another model, a tensor or an
// optimizer state of the wrong dtype or shape, impossible counters, a bad RNG
// state, an entry it does not expect). Modifies neither `model` nor `opt`.
Checkpoint read_checkpoint(const std::string& path, torch::nn::Module& model,
                           const torch::optim::Adam& opt);

// read_checkpoint, then apply: on any error `model` and `opt` are unchanged.
TrainingState load_checkpoint(const std::string& path, torch::nn::Module& model,
                              torch::optim::Adam& opt);

// Collective over `group`: every rank passes its own error ("" when it
// succeeded). When any rank failed, every rank throws the same
// std::runtime_error, "rank <r>: <error>" for the lowest failing rank r.
void fail_together(dtrain::ProcessGroup& group, const std::string& error);

// Collective: rank 0 saves, then every rank learns whether it succeeded.
// Returns on every rank once the checkpoint is durable; otherwise every rank
// throws "rank 0: cannot save checkpoint <path>: ...".
void save_checkpoint_from_rank0(dtrain::ProcessGroup& group, const std::string& path,
                                torch::nn::Module& model, const torch::optim::Adam& opt,
                                const TrainingState& state, const CheckpointFaults& faults = {});

// Collective: every rank reads and validates `path`; the ranks apply it only
// when all of them succeeded. Otherwise every rank throws the first failing
// rank's error ("rank <r>: checkpoint <path> ...") with its `model` and `opt`
// unchanged.
TrainingState load_checkpoint_on_all_ranks(dtrain::ProcessGroup& group, const std::string& path,
                                           torch::nn::Module& model, torch::optim::Adam& opt);
