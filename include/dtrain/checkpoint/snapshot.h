#pragma once

// Snapshots in a peer's memory: a copy of every rank's state, taken often,
// kept in memory outside the workers, so that a failure costs the steps
// since the last snapshot rather than since the last checkpoint on disk.
//
// Under dtrain-run each host runs a snapshot keeper in its launcher (the
// workers' restart does not end it). snapshot() puts each rank's part of
// the state into its own host's keeper and into the keeper of a rank on
// another host (one host: its own keeper only, which survives restarts of
// the workers but not the loss of the host). After a failure the restarted
// job calls restore_snapshot(), which takes the newest snapshot that the
// surviving keepers hold completely.
//
//   dtrain::checkpoint::DistributedState state;  // as for save()
//   dtrain::checkpoint::add_fsdp(state, fsdp, optimizer);
//   int64_t start = 0;
//   const int64_t on_disk = ...;  // the disk checkpoint's step, -1 if none (load() it first)
//   if (auto step = dtrain::checkpoint::restore_snapshot(state, on_disk)) start = *step + 1;
//   for (int64_t step = start; ...; ++step) {
//     train_step();
//     if (step % 10 == 0) dtrain::checkpoint::snapshot(step, state);    // collective
//     if (step % 100 == 0) dtrain::checkpoint::save(dir, state);         // as before
//   }
//
// A snapshot is complete only once every rank's part is in both keepers
// (every rank agrees on that before any marks it complete in its keeper);
// until then the previous one stays the one restored, and a half-sent
// snapshot is never used. One that some keeper marked complete is restored
// even where a host's ranks were stopped before they marked it in theirs
// (the parts they were given are served). A keeper holds its newest complete snapshot and
// the one being written, nothing older; everything goes when dtrain-run
// exits. Restoring needs the same world size and the same state layout as
// the snapshot's (a snapshot is each rank's own part, not resharded: for
// another layout, load() a disk checkpoint).

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "dtrain/arg.h"
#include "dtrain/checkpoint/distributed.h"
#include "dtrain/checkpoint/snapshot_keeper.h"

namespace dtrain::checkpoint {

struct SnapshotOptions {
  // The ranks taking part; null: the default group. Every rank of it calls.
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, process_group) = nullptr;
  // The keeper's socket; empty: DTRAIN_SNAPSHOT_SOCKET, set by dtrain-run.
  DTRAIN_ARG(std::string, keeper_socket) = "";
  // async_snapshot's background collectives: a group of the same ranks in
  // the same order that training does not use. Null: a tcp group made over
  // the default group's store at the group's first async_snapshot, kept.
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, transfer_group) = nullptr;
};

struct SnapshotInfo {
  int64_t step = 0;
  uint64_t part_bytes = 0;    // this rank's part, as kept
  uint64_t sent_bytes = 0;    // of it, sent to another host's keeper (0 on one host)
};

// Collective. Keeps this rank's part of `state` (its tensors' values and
// the metadata) as the snapshot of `step` in its host's keeper and in a
// rank's on another host, then, once every rank's parts are kept, makes it
// the complete snapshot of those keepers. Throws the same Error on every
// rank when any rank's part could not be kept ("checkpoint::snapshot of
// step <s>: rank <r>: <why>": a keeper over DTRAIN_SNAPSHOT_MEMORY, a
// keeper gone); the previous snapshot then stays the complete one.
// Without dtrain-run (no DTRAIN_SNAPSHOT_SOCKET): InvalidArgument.
SnapshotInfo snapshot(int64_t step, const DistributedState& state,
                      const SnapshotOptions& options = SnapshotOptions());

namespace detail {
struct PendingSnapshot;
}

// An asynchronous snapshot in flight.
class AsyncSnapshot {
 public:
  AsyncSnapshot() = default;
  explicit AsyncSnapshot(std::shared_ptr<detail::PendingSnapshot> pending) : pending_(std::move(pending)) {}
  // Blocks until it is kept everywhere and complete; throws its Error (the
  // same on every rank) when it failed.
  SnapshotInfo wait();
  bool done() const;  // never blocks
  bool valid() const { return pending_ != nullptr; }

 private:
  std::shared_ptr<detail::PendingSnapshot> pending_;
};

// Collective. As snapshot(), but training stops only while this rank's
// part is copied into staging buffers (kept for the group's next
// snapshot: one copy of the part stays in host memory between them); a
// background thread (nice 10 more than the process) encodes, sends and
// keeps the parts and completes the snapshot over `transfer_group`. At most one snapshot of a group is in
// flight: the next snapshot call (and restore_snapshot) waits for it, and
// throws its failure when no wait() saw it.
AsyncSnapshot async_snapshot(int64_t step, const DistributedState& state,
                             const SnapshotOptions& options = SnapshotOptions());

// Collective. When the keepers of this job's hosts together hold a complete
// snapshot of a step after `newer_than` taken by as many ranks as the
// group has, fills `state` from the newest (each rank its own part, fetched
// from another host's keeper where its own host lost it) and returns its
// step; otherwise returns nullopt with `state` untouched. A part that does
// not fit `state` (another layout, other names, shapes or dtypes) throws
// InvalidArgument on every rank, `state` untouched.
std::optional<int64_t> restore_snapshot(DistributedState& state, int64_t newer_than = -1,
                                        const SnapshotOptions& options = SnapshotOptions());

}  // namespace dtrain::checkpoint
