#pragma once

// Distributed checkpoints (torch.distributed.checkpoint's idea): every rank
// writes its own part of the training state to its own file, in parallel,
// and one metadata file, written last and atomically, makes the checkpoint
// exist. Loading reshards: a checkpoint saved by N ranks loads on any number
// of ranks, each reading only the pieces that overlap what it holds. Files
// are tensor files (docs/tensor-file.md): validated, never unpickled.
//
//   dtrain::checkpoint::DistributedState state;
//   dtrain::checkpoint::add_fsdp(state, fsdp, optimizer);    // or add_module / add_zero
//   state.metadata["epoch"] = std::to_string(epoch);
//   dtrain::checkpoint::save("ckpt", state);                 // collective
//   ...                                                      // any world size later:
//   dtrain::checkpoint::load("ckpt", state);                 // fills the same tensors
//
// The state names views of the live tensors: save() reads them, load()
// writes into them. docs/checkpoint.md has the directory layout.

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/arg.h"
#include "dtrain/checkpoint/tensor_file.h"
#include "dtrain/fsdp.h"
#include "dtrain/process_group.h"

namespace torch::optim {
class Optimizer;
}

namespace dtrain {
class ZeroRedundancyOptimizer;
}  // namespace dtrain

namespace dtrain::checkpoint {

// A rank's piece of a tensor of `numel` elements that all ranks together
// hold, in one of two forms:
// - a flat range (`shape` empty): `local` (1-D, contiguous) is elements
//   [offset, offset + local.numel()) of the whole, flattened; the whole's
//   shape is not recorded (FSDP's and ZeRO's flat shards);
// - a box (`shape` set, `numel` its product, `offset` unused): `local`
//   (contiguous, shape.size() dimensions) is [offsets[d], offsets[d] +
//   local.size(d)) in each dimension d of a whole of `shape` (tensor
//   parallelism's shards: ShardedTensor::box).
// A flat range may also say its whole's shape (`flat_shape`, its product
// `numel`): add_fsdp_parameters' pieces of each parameter do, so that the
// entry can be read whole (export_safetensors, a replicated or TP state)
// while each rank saves and loads only its range.
// The pieces of different ranks are either the same piece (replicas:
// saved once) or disjoint. A box entry loads as boxes of any other split,
// and as a replicated tensor of its whole shape; a replicated entry loads
// as boxes too.
struct ShardedTensor {
  at::Tensor local;
  int64_t offset = 0;
  int64_t numel = 0;
  std::vector<int64_t> shape = {};
  std::vector<int64_t> offsets = {};
  std::vector<int64_t> flat_shape = {};

  static ShardedTensor box(at::Tensor local, std::vector<int64_t> shape, std::vector<int64_t> offsets) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return ShardedTensor{std::move(local), 0, n, std::move(shape), std::move(offsets), {}};
  }
  bool is_box() const { return !shape.empty(); }
};

struct DistributedState {
  // The same on every rank (model parameters under DDP, buffers, step
  // counters): saved once, spread over the ranks' files by size.
  std::map<std::string, at::Tensor> replicated;
  std::map<std::string, ShardedTensor> sharded;
  // Strings: rank 0's are saved; load() replaces these with the saved ones.
  std::map<std::string, std::string> metadata;
  // Run by load() once every tensor is filled (the add_* helpers use them
  // to put values that are not tensors, such as step counts, back).
  std::vector<std::function<void()>> after_load;
  // Run first by save(), async_save() and snapshot(): the add_* helpers'
  // read such values as they are at that moment, so a state built once
  // saves the optimizer's step counts of each save, not of when it was
  // built.
  std::vector<std::function<void()>> before_save;
};

struct SaveOptions {
  // The ranks saving; null: the default group. Every rank of it calls save.
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, process_group) = nullptr;
  // Test hooks: this rank's data file write dies half way (SIGKILL), or
  // rank 0 dies after every data file is written, before the commit.
  DTRAIN_ARG(WriteFaults, faults) = WriteFaults();
  DTRAIN_ARG(bool, die_before_commit) = false;
};

// Collective. Writes this rank's data file, then (rank 0, once every
// rank's file is durable) the metadata file, atomically; then removes the
// files of the checkpoint it replaces. A crash at any point leaves the
// previous checkpoint in `dir` loadable. Ranks may pass different entries
// (a pipeline's stages) and the same ones (replicas): each is written once.
// An entry must have the same size (and kind, and dtype) on every rank
// holding it, and a sharded entry's pieces must be the same piece or
// disjoint and cover it (InvalidArgument otherwise, the same on every
// rank). When a rank cannot write (a full disk, an
// unwritable directory), every rank throws the same Error,
// "checkpoint::save <dir>: rank <r>: <why>", and the previous checkpoint
// stays the one in `dir`.
void save(const std::string& dir, const DistributedState& state, SaveOptions options = SaveOptions());

// Not collective: fills every tensor of `state` from the checkpoint in
// `dir` (any world size), and its metadata. Everything is read and checked
// first (this rank's part of the state is staged in memory once), so a name
// missing from the checkpoint, a shape or dtype that differs, a damaged
// file throws InvalidArgument naming it with `state` untouched.
void load(const std::string& dir, DistributedState& state);

// What a checkpoint directory holds, from its metadata file alone.
struct CheckpointInfo {
  int world_size = 0;  // of the ranks that saved it
  std::vector<std::string> replicated, sharded;
  std::map<std::string, std::string> metadata;
};
CheckpointInfo inspect(const std::string& dir);

// ---- building states --------------------------------------------------------

// The module's parameters and buffers ("<prefix>param/<name>",
// "<prefix>buffer/<name>"), replicated: a DDP replica or a single process.
// Parameters of modules that hold parts of whole tensors (ShardedParameters:
// the tensor-parallel layers) are boxes of the whole instead, so that the
// checkpoint loads at another tensor-parallel size or in one process.
void add_module(DistributedState& state, torch::nn::Module& module, const std::string& prefix = "");
// The optimizer's state for `module`'s parameters, replicated
// ("<prefix>optim/<name>/<field>"), or boxes where the parameter is one.
// Adam, AdamW and SGD; state not created yet is created as the optimizer's
// first step would (zeros, step 0).
void add_optimizer(DistributedState& state, torch::optim::Optimizer& optimizer,
                   torch::nn::Module& module, const std::string& prefix = "");
// ZeroRedundancyOptimizer's sharded state ("<prefix>zero/<i>/<field>" for
// parameter i, each rank saving the piece it holds, and "<prefix>zero/step"),
// the same for ZeRO-1 and ZeRO-2, so either loads it at any world size; the
// parameters themselves come from add_module.
void add_zero(DistributedState& state, ZeroRedundancyOptimizer& optimizer,
              const std::string& prefix = "");

// FSDP's shards ("<prefix>fsdp/<unit>/param", "<unit>" being "root" for
// the root unit), the optimizer's state of them ("<prefix>fsdp/<unit>/<field>")
// and the module's buffers, replicated. For a module that holds
// tensor-parallel layers (ShardedParameters), whose flat units differ from
// one TP rank to the next, instead the entries add_module and
// add_optimizer write ("<prefix>param/<name>", "<prefix>optim/<name>/<field>"):
// each parameter and its state gathered whole over the FSDP group (a
// collective, here and again at every save, snapshot and export of the
// state, so a state built once saves the values of that moment; memory
// for one whole copy of them while the state lives), its TP box of the
// whole layer; load() puts this rank's slice back into the flat shards. Such a checkpoint loads at any TP and DP size, under
// FSDP, DDP or in one process.
void add_fsdp_shards(DistributedState& state, const std::vector<FSDPShard>& shards,
                     torch::optim::Optimizer& optimizer, torch::nn::Module& module,
                     const std::string& prefix);
template <typename ModuleType>
void add_fsdp(DistributedState& state, FullyShardedDataParallel<ModuleType>& fsdp,
              torch::optim::Optimizer& optimizer, const std::string& prefix = "") {
  add_fsdp_shards(state, fsdp.shard_layout(), optimizer, *fsdp.module(), prefix);
}

// FSDP's parameters by name ("<prefix>param/<name>", as add_module names
// them) and its buffers: each parameter as the flat range of it that this
// rank's shard holds, with the parameter's shape (views of the shard: no
// collective, no copy); a checkpoint of them loads into add_module's
// state and into any FSDP size, and export_safetensors writes each whole
// while import_safetensors reads into each rank only its range. For a
// module of tensor-parallel layers, each parameter is instead its TP box
// of the whole layer, gathered over the FSDP group (a collective, here and
// again at every save and export; one whole copy in memory while the
// state lives), and load() puts this rank's slice back into the flat
// shards. For weights that leave the job (export_safetensors) or come in
// without optimizer state.
void add_fsdp_parameter_shards(DistributedState& state, const std::vector<FSDPShard>& shards,
                               torch::nn::Module& module, const std::string& prefix);
template <typename ModuleType>
void add_fsdp_parameters(DistributedState& state, FullyShardedDataParallel<ModuleType>& fsdp,
                         const std::string& prefix = "") {
  add_fsdp_parameter_shards(state, fsdp.shard_layout(), *fsdp.module(), prefix);
}

}  // namespace dtrain::checkpoint
