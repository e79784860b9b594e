#pragma once

// Where a checkpoint's bytes go and come from: the one interface every
// form of saving and loading goes through (PyTorch DCP's StorageWriter and
// StorageReader). The Checkpointer (checkpoint/checkpointer.h) runs the
// steps every save shares — the state's before_save hooks, the local
// checks, the plan, the staging copy, the background thread, the
// companion group — and hands a storage only this rank's part of the
// state to write, or a state to fill. Each implementation is a folder of
// storage/ and includes no other's: directory/ (tensor files on a shared
// file system), keepers/ (snapshots in the hosts' keepers), safetensors/
// (Hugging Face's files). docs/design/checkpoint-storage.md states the
// contract and writes a new storage in one file.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/plan/save_plan.h"
#include "dtrain/checkpoint/distributed.h"

namespace dtrain {
class ProcessGroup;
}

namespace dtrain::checkpoint::storage {

using files::SavePlan;

// This rank's part of one save: views of the state's tensors, or the
// staging copies of them when the save runs in the background.
struct Part {
  std::map<std::string, at::Tensor> replicated;  // the entries this rank writes
  std::map<std::string, ShardedTensor> sharded;  // its pieces
  std::map<std::string, std::string> metadata;   // the state's (the user's strings)
};

// What a write put where, for what the caller reports (SnapshotInfo).
struct Written {
  uint64_t part_bytes = 0;  // this rank's part as stored
  uint64_t sent_bytes = 0;  // of it, sent to another host
};

class Writer {
 public:
  virtual ~Writer() = default;
  // What every error of this save starts with ("checkpoint::save <dir>").
  virtual const std::string& context() const = 0;
  // The background lane of its saves (at most one job in flight per group
  // and lane), also the purpose of the lane's companion group:
  // "async_save" for files, "snapshot" for keepers.
  virtual const char* lane() const = 0;
  // Whether write() moves CPU tensors between ranks, which an nccl group
  // cannot carry: it then gets a tcp companion of the same ranks.
  virtual bool needs_cpu_group() const { return false; }
  // Collective over the saving group, on the caller's thread, after the
  // plan: what the ranks agree on before writing (a checkpoint's token).
  // An error here is the same on every rank or thrown before any rank
  // left (a collective's).
  virtual void prepare(ProcessGroup& /*group*/) {}
  // This rank's part. By default the plan's: the replicated entries it
  // assigns to this rank and the pieces this rank writes (a replica's
  // piece once).
  virtual Part select(const DistributedState& state, const SavePlan& plan, int rank) const;
  // Collective over `group` (the saving group's ranks, in its order; on a
  // background thread a companion of them): writes `part` and commits it.
  // Nothing of this save is what a reader sees until every rank's part is
  // stored; a failure on any rank — `prior_error`, this rank's failure
  // before it got here, included — makes every rank throw the same Error
  // and leaves the previous save the one read. May run on another thread
  // than prepare() and select() (never at once with them).
  virtual Written write(const Part& part, const SavePlan& plan, const std::shared_ptr<ProcessGroup>& group,
                        const std::string& prior_error) = 0;
};

// {destination, value}: a value of the destination's number of elements.
using Fills = std::vector<std::pair<at::Tensor, at::Tensor>>;

// What a reader read for a state: every destination's value, checked.
struct Loaded {
  Fills fills;
  // Replaces the state's metadata when set.
  std::optional<std::map<std::string, std::string>> metadata;
};

class Reader {
 public:
  virtual ~Reader() = default;
  // Reads and checks everything `state` holds without changing it: a
  // missing entry, another shape or dtype, a damaged byte throws
  // InvalidArgument naming it. nullopt: nothing to read (a restore that
  // finds no complete snapshot). Collective only where the storage says.
  virtual std::optional<Loaded> read(const DistributedState& state) = 0;
};

// A committed checkpoint read one whole entry at a time (what a
// conversion into another storage's files needs: export_safetensors).
struct EntryInfo {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

class WholeEntries {
 public:
  virtual ~WholeEntries() = default;
  // Every entry in name order, without reading values; an entry that
  // cannot be read whole is an InvalidArgument naming it.
  virtual std::vector<EntryInfo> entries() = 0;
  virtual at::Tensor read(const EntryInfo& entry) = 0;  // whole, on the CPU
  virtual std::map<std::string, std::string> metadata() = 0;  // the user's
};

}  // namespace dtrain::checkpoint::storage
