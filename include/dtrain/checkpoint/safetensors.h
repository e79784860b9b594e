#pragma once

// Hugging Face safetensors in and out of a training state, from and into
// any layout (DDP, FSDP, HSDP, pipeline stages, tensor parallelism): the
// format vLLM, transformers and torchtune read, so weights trained with
// dtrain leave the job without a converter.
//
//   dtrain::checkpoint::DistributedState weights;
//   dtrain::checkpoint::add_module(weights, *model);             // or add_fsdp_parameters(weights, fsdp)
//   dtrain::checkpoint::export_safetensors("hf-out", weights);   // collective
//   ...
//   dtrain::checkpoint::import_safetensors("hf-out", weights);   // any layout, any world size
//
// Each tensor is written whole, with its dtype and shape, in files of at
// most max_shard_bytes: "model.safetensors", or "model-00001-of-00003.
// safetensors" ... and "model.safetensors.index.json" (Hugging Face's
// names). Reading checks each file's header against its size first
// (docs/checkpoint.md: a hostile file is an InvalidArgument naming the file
// and the field); nothing in it runs code.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "dtrain/arg.h"
#include "dtrain/checkpoint/distributed.h"

namespace dtrain::checkpoint {

struct SafetensorsOptions {
  // A state entry's name in the files; "" leaves the entry out. A name
  // holding "{e}" splits the entry along its first dimension into one
  // tensor per index, "{e}" replaced by the index (import stacks them back,
  // each rank reading only its indices). Null: the parameters and buffers
  // add_module names ("<prefix>param/w", "<prefix>buffer/b", any prefix)
  // under their module names ("w", "b"), a GroupedExperts' w1, w3 and w2
  // ("....experts.w1") as Hugging Face's per-expert
  // "....experts.{e}.gate_proj.weight", "up_proj" and "down_proj", and
  // nothing else (not the optimizer's state).
  DTRAIN_ARG(std::function<std::string(const std::string&)>, rename) = nullptr;
  // Export: the most tensor bytes per file (a larger tensor gets a file of
  // its own), as Hugging Face's max_shard_size (5 GB).
  DTRAIN_ARG(int64_t, max_shard_bytes) = 5000000000;
  // Export: the group it is collective over; null: the default group.
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, process_group) = nullptr;
};

// Collective. Writes the chosen entries of `state` whole into `dir` (made
// if missing; every rank must see it, as for save): they go through a
// distributed checkpoint in dir/.dtrain-export, which rank 0 then reads
// whole, one file's tensors at a time, writes each file atomically, and
// removes; the others wait for rank 0's word (every quarter of the group's
// timeout: the timeout bounds a stall, not the conversion). The set is
// replaced at one rename: several files go under names no earlier file
// has, then their index replaces the earlier one (a crash before leaves
// the earlier export whole through its index). Entries saved as flat
// ranges (add_fsdp's units without tensor parallelism, add_zero) have no
// shape: InvalidArgument (use add_fsdp_parameters). state.metadata goes
// into each file's __metadata__. A failure on any rank throws on every
// rank.
void export_safetensors(const std::string& dir, const DistributedState& state,
                        const SafetensorsOptions& options = SafetensorsOptions());

// Not collective. Fills the chosen entries of `state` from the
// .safetensors files in `dir` (each file's header says where its tensors
// are; the index is not needed): a replicated entry whole, a box or flat
// range its part. Every tensor is read and checked (its name present once,
// its dtype and whole shape equal to the entry's) before any entry
// changes; then state.after_load runs.
void import_safetensors(const std::string& dir, DistributedState& state,
                        const SafetensorsOptions& options = SafetensorsOptions());

}  // namespace dtrain::checkpoint
