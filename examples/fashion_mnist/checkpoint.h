#pragma once

// Checkpoints that survive crashes: rank 0 writes to a temporary file,
// fsyncs it, renames it over the previous checkpoint and fsyncs the
// directory, so at any moment the file on disk is a complete checkpoint (the
// previous one until the rename). Loading reads and validates everything
// before it touches the model or the optimizer.

#include <torch/torch.h>

#include <cstdint>
#include <string>

struct TrainingState {
  int64_t epoch = 0;            // epoch in progress
  int64_t step_in_epoch = 0;    // batches of that epoch already trained
  int64_t global_step = 0;
  int64_t world_size = 1;
};

// Test hook: when set, the writer SIGKILLs itself half way through writing.
struct CheckpointFaults {
  bool die_while_writing = false;
};

void save_checkpoint(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer& opt,
                     const TrainingState& state, const CheckpointFaults& faults = {});

// Throws std::runtime_error naming the file and the problem (missing,
// truncated or corrupt, written for another model) without modifying
// `model` or `opt`.
TrainingState load_checkpoint(const std::string& path, torch::nn::Module& model,
                              torch::optim::Optimizer& opt);
