#pragma once

// Asynchronous distributed checkpoints (torch.distributed.checkpoint's
// async_save): training stops only while this rank's part of the state is
// copied into host buffers; a background writer then writes and commits
// the checkpoint exactly as save() does (the same files, the same atomic
// commit, the same all-ranks-or-none failure) while training goes on.
//
//   auto pending = dtrain::checkpoint::async_save("ckpt", state);  // collective
//   ... train on: the state may change, the copy is what gets written ...
//   pending.wait();  // or not: the next save waits for it, and throws its failure
//
// The writer is a thread of this process, at a lower CPU priority (nice
// 10 more than the process's): where cores are short, training goes first
// and the write takes longer.
//
// At most one save of a group is in flight: async_save and save first wait
// for the previous one. A failed asynchronous save is never silent: wait()
// throws it, and when nobody called wait(), the next save or async_save of
// that group throws it instead of saving.

#include <exception>
#include <memory>
#include <string>

#include "dtrain/arg.h"
#include "dtrain/checkpoint/distributed.h"

namespace dtrain::checkpoint {

namespace detail {
struct PendingSave;
}

struct AsyncSaveOptions {
  // The ranks saving; null: the default group. Every rank of it calls
  // async_save, at the same point of its program.
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, process_group) = nullptr;
  // The group the background writer's collectives use (its agreement on
  // the outcome and the commit), which must not be one training uses: two
  // threads' collectives on one group would interleave differently on
  // different ranks. Its ranks must be the saving group's, in its order.
  // Null: a tcp group of the same ranks, made over the default group's
  // store at the first async_save of that group and kept (PyTorch's
  // torchtitan makes a gloo group for the same reason).
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, writer_group) = nullptr;
  // Keep the staging buffers for the next save of this group (true: no
  // allocation, and no page faults, in the next stall; one copy of this
  // rank's part stays allocated between saves).
  DTRAIN_ARG(bool, reuse_staging) = true;
  // Copy into the staging buffers on the writer's thread too
  // (torch.distributed.checkpoint's asynchronous staging): async_save
  // returns after the plan, and the copy runs while training computes its
  // next forward and backward, which read the state but do not write it.
  // The state must not change before the handle's wait_staged() returns:
  // call it before the optimizer's next step (and before a forward that
  // updates buffers in the state, as BatchNorm's running statistics).
  // CUDA tensors: the copies wait for what was queued on the caller's
  // current streams when async_save was called (an event per device).
  DTRAIN_ARG(bool, stage_in_background) = false;
  // Test hooks: this rank dies (SIGKILL) half way through staging, or in
  // the background writer (SaveOptions' faults and die_before_commit).
  DTRAIN_ARG(bool, die_while_staging) = false;
  DTRAIN_ARG(WriteFaults, faults) = WriteFaults();
  DTRAIN_ARG(bool, die_before_commit) = false;
};

// What async_save returns: copies share one pending save.
class AsyncSaveHandle {
 public:
  AsyncSaveHandle() = default;
  explicit AsyncSaveHandle(std::shared_ptr<detail::PendingSave> pending);

  // Blocks until the checkpoint is committed (returns) or has failed
  // (throws save()'s Error, the same on every rank). Bounded by what bounds
  // save(): the writer group's timeout for a rank that stops answering.
  void wait() const;
  // Blocks until this rank's part is in the staging buffers (at once
  // unless stage_in_background): from then on the state may change. A
  // failure to stage is wait()'s, not this one's.
  void wait_staged() const;
  // Whether the background writer has finished, either way; never blocks.
  bool done() const;
  // Its failure once done (null while running, or when it committed).
  std::exception_ptr error() const;
  const std::string& dir() const;
  bool valid() const { return static_cast<bool>(pending_); }

 private:
  std::shared_ptr<detail::PendingSave> pending_;
};

// Collective over the saving group, like save(): checks and plans the save
// with the other ranks (an InvalidArgument here is the same on every rank,
// as save()'s), copies this rank's part of `state` into staging buffers
// (pinned host memory for CUDA tensors), starts the background writer and
// returns. A failure from then on (staging, a full disk, a rank that dies)
// is the handle's, and every rank's. A process that ends with a save in
// flight waits for it first. Once this returns, `state`'s tensors may be
// changed or freed: the copy is written.
AsyncSaveHandle async_save(const std::string& dir, const DistributedState& state,
                           AsyncSaveOptions options = AsyncSaveOptions());

}  // namespace dtrain::checkpoint
