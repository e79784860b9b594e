#pragma once

// Training that goes on when replicas die (torchft's Manager, in C++).
//
// The job runs as R replica groups, each launched as usual (its own
// dtrain-run, store and inner layout: DDP, FSDP, ...), plus one lighthouse
// (dtrain/ft/lighthouse.h, or the dtrain-lighthouse tool). Every rank of
// every replica holds a Manager; a step reads like DDP's with two calls:
//
//   dtrain::checkpoint::DistributedState state;         // what a joiner takes
//   dtrain::checkpoint::add_module(state, *net);
//   dtrain::checkpoint::add_optimizer(state, optimizer, *net);
//   dtrain::ft::Manager manager(state, dtrain::ft::ManagerOptions().replica_id("a"));
//   dtrain::DistributedDataParallel ddp(net);            // within the replica
//   ddp.register_comm_hook(dtrain::ft::allreduce_hook(manager));
//   for (...) {
//     manager.start_quorum();                            // overlaps the forward
//     optimizer.zero_grad();
//     loss_fn(ddp.forward(x), y).backward();             // averaged over live replicas
//     if (manager.should_commit()) optimizer.step();
//   }
//
// torchft's names, side by side: Manager(pg, load_state_dict, state_dict,
// min_replica_size, use_async_quorum, init_sync, timeout, quorum_timeout,
// world_size_mode) -> Manager(state, ManagerOptions().min_replicas()
// .async_quorum().init_sync().timeout().quorum_timeout().world_size_mode()); start_quorum(), should_commit(),
// allreduce(), current_step(), num_participants(), is_participating(),
// report_error(), errored() are the same. DistributedDataParallel(manager,
// module) is DDP with allreduce_hook(manager); REPLICA_GROUP_ID and
// TORCHFT_LIGHTHOUSE are DTRAIN_FT_REPLICA_ID and DTRAIN_FT_LIGHTHOUSE.
//
// Contract:
//  - start_quorum() asks the lighthouse (through the replica's first rank)
//    for the step's quorum on a thread of its own and returns at once
//    (async_quorum; else once the quorum is formed and this replica
//    healed). When the quorum's id changed (its members, a member's
//    restart, or a step that did not commit), each rank's cross-replica
//    group — the ranks of the same place in every member replica — is
//    built anew, its rendezvous in a store the place's first member serves
//    (named "ft/<place>@<quorum>", which the flight recorder records).
//  - A member behind the quorum's highest committed step heals: the rank of
//    its place in a member at that step sends its whole state
//    (checkpoint/distributed.h's DistributedState: parameters, optimizer
//    state, step counts, metadata such as a sampler's position) over the
//    cross-replica group, checked (storage/peer) and loaded into `state`
//    before should_commit() returns; it then commits with the others,
//    bitwise equal to them. With init_sync, at step 0 every member takes
//    the first member's state.
//  - allreduce() averages a tensor over the step's participants (members at
//    the highest step, or the first min_replicas of them with
//    kFixedWithSpares); a member healing asynchronously, or a spare,
//    contributes zeros and takes the average all the same.
//  - Errors of the cross-replica traffic (a peer that died: a closed
//    connection, a timeout; no quorum within quorum_timeout; a heal that
//    failed its checks) never throw out of these calls: they mark the step,
//    and should_commit() returns false on every rank of every member.
//    Bad input does throw, at once: a lighthouse unreachable at
//    construction, a refused job token, a layout other than the job's.
//  - should_commit() is collective over the replica's ranks and, through
//    the cross-replica groups, over the members: true when every rank of
//    every member had no error this step and the quorum had at least
//    min_replicas members; then current_step() advances.
//  - The replica's own group failing (one of its ranks died) is not
//    survived by that replica: its calls throw, its processes exit and its
//    launcher restarts it; it heals from the others when it comes back.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/arg.h"
#include "dtrain/ddp/comm_hooks.h"
#include "dtrain/process_group.h"
#include "dtrain/store/store.h"

namespace dtrain::checkpoint {
struct DistributedState;
}

namespace dtrain::ft {

// What the global batch does when replicas come and go (torchft's
// WorldSizeMode): kDynamic, every member at the quorum's step participates
// (the batch shrinks and grows with them); kFixedWithSpares, exactly
// min_replicas participate (the first in id order) and the others are
// spares: their gradients count as zeros, they take the same update and so
// hold the same state, and one stands in at the next step when a
// participant dies.
enum class WorldSizeMode { kDynamic, kFixedWithSpares };

struct ManagerOptions {
  // The lighthouse, "host:port"; empty: DTRAIN_FT_LIGHTHOUSE.
  DTRAIN_ARG(std::string, lighthouse) = "";
  // This replica's id (1 to 64 of A-Z a-z 0-9 . _ -), the same on each of
  // its ranks and kept across its restarts; empty: DTRAIN_FT_REPLICA_ID.
  DTRAIN_ARG(std::string, replica_id) = "";
  // The replica's ranks; null: the default group when one is initialized,
  // else this process alone.
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, group) = nullptr;
  // Where the replica's first rank hands the quorum to the others; null:
  // the default group's store. Unused by a replica of one rank.
  DTRAIN_ARG(std::shared_ptr<Store>, store) = nullptr;
  // Steps commit only with at least this many replicas in the quorum.
  DTRAIN_ARG(int, min_replicas) = 1;
  DTRAIN_ARG(WorldSizeMode, world_size_mode) = WorldSizeMode::kDynamic;
  // Quorum on a thread of its own, overlapping the forward (a healing
  // replica's gradients of that step do not count); false: start_quorum()
  // returns once the quorum is formed and this replica healed, and every
  // member's gradients count.
  DTRAIN_ARG(bool, async_quorum) = true;
  // At step 0 every member takes the first member's state.
  DTRAIN_ARG(bool, init_sync) = true;
  // Each cross-replica operation (a group's build, an all-reduce, a heal).
  DTRAIN_ARG(std::chrono::milliseconds, timeout) = std::chrono::seconds(60);
  // Waiting for the lighthouse's quorum.
  DTRAIN_ARG(std::chrono::milliseconds, quorum_timeout) = std::chrono::seconds(60);
  // Reaching the lighthouse at construction.
  DTRAIN_ARG(std::chrono::milliseconds, connect_timeout) = std::chrono::seconds(10);
  // How often the replica's first rank tells the lighthouse it lives.
  DTRAIN_ARG(std::chrono::milliseconds, heartbeat_interval) = std::chrono::milliseconds(100);
  // The cross-replica groups' backend (CPU tensors).
  DTRAIN_ARG(std::string, backend) = "tcp";
  // The job token for the lighthouse (TcpStoreOptions::token).
  DTRAIN_ARG(std::string, token) = "";
};

// A rank's samples of a step (Manager::step_samples): global sample
// indices [first, first + count) of the job's order of the data (index i
// is sample order[i mod N] of epoch i / N, in an order of your choosing,
// the same on every replica).
struct StepSamples {
  int64_t first = 0;
  int64_t count = 0;
  int64_t step_first = 0;  // the whole step's: [step_first, step_first + step_count)
  int64_t step_count = 0;
};

// The quorum of the current step, as this rank sees it.
struct QuorumInfo {
  std::string id;
  std::vector<std::string> members;  // replica ids, in id order
  int replica_rank = 0;              // this replica among them
  int64_t max_step = 0;
  int participants = 0;
  bool participating = false;  // its gradients count (not a spare, not healing asynchronously)
  bool healing = false;
};

class Manager {
 public:
  // Connects to the lighthouse (the replica's first rank also starts its
  // heartbeats) and checks the options; the state is read when a peer
  // heals from this replica and written when this one heals, and must
  // outlive the manager. It may be filled after construction, up to the
  // first start_quorum() (which fingerprints its layout for the
  // lighthouse).
  Manager(checkpoint::DistributedState& state, ManagerOptions options = ManagerOptions());
  ~Manager();
  Manager(const Manager&) = delete;
  Manager& operator=(const Manager&) = delete;

  void start_quorum();
  // This rank's samples of the step, each sample trained in exactly one
  // committed step across failures: the step's block starts where the
  // committed ones end (a number the manager keeps and a healing replica
  // takes from its peer), is `per_rank` x the replica's ranks x the
  // step's participants long, and is cut in that order (participant, then
  // rank). A spare's share is empty (count 0): its gradients count as zeros,
  // so any batch will do for its forward.
  // A step that does not commit leaves its block to the next. Needs
  // async_quorum(false), so that every member, a healed one included, trains
  // its share (InvalidArgument otherwise); call it after start_quorum().
  StepSamples step_samples(int64_t per_rank);
  // Samples committed so far (step_samples' blocks).
  int64_t committed_samples() const;
  // Averages `tensor` (a CPU tensor) over the participants, in place; on an
  // error marks the step (the tensor's values are then any: the step does
  // not commit).
  void allreduce(at::Tensor tensor);
  // The same, returning at once (torchft's allreduce returns a Future): the
  // Work finishes once the average is in `tensor` or the error is recorded;
  // it never fails.
  WorkPtr allreduce_async(at::Tensor tensor);
  bool should_commit();

  // Records an error of this step (the step will not commit).
  void report_error(std::exception_ptr error);
  // This step's first error; null when none.
  std::exception_ptr errored() const;
  // Committed steps so far (taken from the peer on a heal).
  int64_t current_step() const;
  // Waits for the step's quorum; 0 when it failed.
  int num_participants();
  // Whether this replica's gradients count in the step (not healing
  // asynchronously, not a spare).
  bool is_participating();
  QuorumInfo quorum();
  // The options as given (the replica id and lighthouse as resolved).
  const ManagerOptions& options() const;
  // The replica's ranks, and this rank's cross-replica group of the step
  // (null while none: a failed quorum).
  ProcessGroup& replica_group() const;
  std::shared_ptr<ProcessGroup> replica_peers();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// DDP's gradient average over the replica's ranks, then over the live
// replicas (the quorum's participants): plug it into a
// DistributedDataParallel over the replica's group.
CommHook allreduce_hook(Manager& manager);

// FT-HSDP: FSDP sharded over the replica's ranks, each unit's gradient
// shard averaged over the live replicas (the same place's rank of each
// holds the same shard):
//   FullyShardedDataParallel fsdp(net, FSDPOptions()
//       .process_group(replica)              // the group the manager was given
//       .replicate_average(ft::replicate_average(manager)));
// Build the manager's DistributedState from the FSDP model
// (checkpoint::add_fsdp, add_fsdp_optimizer) after wrapping it: a healing
// rank takes its own shard from the same place of a live replica.
std::function<WorkPtr(at::Tensor)> replicate_average(Manager& manager);

}  // namespace dtrain::ft
