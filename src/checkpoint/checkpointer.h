#pragma once

// The one machinery behind every form of saving (save, async_save,
// snapshot, async_snapshot, export_safetensors' staging) and loading
// (load, restore_snapshot, import_safetensors): a process group's
// Checkpointer runs what they share and leaves the rest to a storage
// (checkpoint/storage/storage.h):
//
//   save:  wait for the lane's job in flight (and throw its unseen failure)
//          -> the state's before_save hooks -> local checks -> the plan
//          (collective) -> the storage's prepare (collective) -> this
//          rank's part -> [staging copy, background thread on a companion
//          group] -> the storage's write and commit
//   load:  the storage's read (everything checked) -> the copies into the
//          state -> its metadata -> its after_load hooks
//
// A group has one Checkpointer (made at its first save, kept while the
// group lives) with a lane per kind of storage: at most one background job
// in flight per lane, the lane's companion group (made once) and its
// staging buffers. The free functions of dtrain/checkpoint/ are thin forms
// of these calls.

#include <exception>
#include <map>
#include <memory>
#include <string>

#include "checkpoint/background.h"
#include "checkpoint/storage/storage.h"
#include "dtrain/checkpoint/distributed.h"
#include "dtrain/process_group.h"

namespace dtrain::checkpoint {

// A background save: the handles' shared state (background.h's outcome),
// what its failure is called when a later call reports it ("the
// asynchronous save to <dir>"), and what it wrote.
struct BackgroundJob : background::Outcome {
  std::string described;
  storage::Written written;  // set before finish()
};

struct BackgroundOptions {
  // The user's group for the background collectives (checked: the same
  // ranks in the same order, not the group itself); null: the lane's
  // companion. Errors name it `companion_option`, the group
  // `group_called`, and the thread's collectives `background_called`.
  std::shared_ptr<ProcessGroup> companion;
  std::string companion_option = "writer_group";
  std::string group_called = "the saving group";
  std::string background_called = "the background writer's collectives";
  bool reuse_staging = true;
  bool stage_in_background = false;
  bool die_while_staging = false;  // test hook: SIGKILL half way through staging
};

class Checkpointer {
 public:
  // `group`'s Checkpointer. Not thread-safe per group: one thread (the
  // group's caller) saves through it, as the group's collectives require.
  static std::shared_ptr<Checkpointer> of(const std::shared_ptr<ProcessGroup>& group);

  explicit Checkpointer(std::shared_ptr<ProcessGroup> group);
  ~Checkpointer();  // waits for the jobs in flight
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Waits for `lane`'s job in flight, if any; throws its failure when no
  // wait() has seen it ("<context>: <described> before it failed: ...").
  void wait_for(const std::string& lane, const std::string& context);
  // The group for `lane`'s traffic of CPU tensors: the group itself, or,
  // for an nccl group, the lane's tcp companion.
  std::shared_ptr<ProcessGroup> cpu_group(const std::string& lane);

  // Collective over the group: saves `state` through `writer` on this thread.
  storage::Written save(storage::Writer& writer, const DistributedState& state);
  // Collective over the group: plans and stages on this thread (unless
  // options.stage_in_background), then writes on a background thread over
  // the companion group; `job` (a fresh one) is the handles'. Its failure
  // from the staging on is the job's, and every rank's.
  void save_in_background(std::unique_ptr<storage::Writer> writer, const DistributedState& state,
                          const std::shared_ptr<BackgroundJob>& job, const BackgroundOptions& options);

  // The group's (the caller holds it during every call).
  std::shared_ptr<ProcessGroup> group() const;
  // Whether a lane's job is still running.
  bool busy() const;

 private:
  struct Lane;
  Lane& lane(const std::string& name);
  std::shared_ptr<ProcessGroup> companion(Lane& lane, const BackgroundOptions& options, const std::string& context);

  std::weak_ptr<ProcessGroup> group_;  // not kept alive by its Checkpointer
  std::map<std::string, std::unique_ptr<Lane>> lanes_;
};

// Not collective unless the reader is: fills `state` from `reader`
// (everything read and checked first, `state` untouched on a throw);
// false when the reader had nothing.
bool load_state(storage::Reader& reader, DistributedState& state);

}  // namespace dtrain::checkpoint
