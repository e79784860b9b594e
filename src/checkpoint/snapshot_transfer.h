#pragma once

// The halves of a snapshot (snapshot.cpp), shared with async_snapshot.cpp:
// stage() on the caller's thread (the state read and encoded), transfer()
// on whichever thread then sends and keeps the parts and commits.

#include <chrono>
#include <memory>
#include <string>

#include "checkpoint/snapshot_wire.h"
#include "dtrain/checkpoint/snapshot.h"

namespace dtrain::checkpoint::snapshot_detail {

namespace wire = snapshot_wire;

// A request to this host's keeper: a few GiB over a Unix socket.
constexpr auto kKeeperTimeout = std::chrono::minutes(5);
constexpr uint64_t kListingBytes = 64 + 12ull * wire::kMaxWorld;

struct Context {
  std::shared_ptr<ProcessGroup> group;  // the caller's; `bytes` carries the parts (CPU tensors)
  std::shared_ptr<ProcessGroup> bytes;
  std::string socket, what;
  std::string key;  // the group's in its keepers: its name and ranks (snapshot_wire.h)
  int rank = 0, world = 0;

  int global(int group_rank) const {
    const auto& g = bytes->global_ranks();
    return g.empty() ? group_rank : g[group_rank];
  }
  std::string ask(wire::Op op, int64_t step, int part_rank, std::string payload = {}, uint64_t max_answer = 0) const {
    wire::Request r{op, step, static_cast<uint32_t>(part_rank), static_cast<uint32_t>(world), std::move(payload), key};
    return wire::call(socket, r, max_answer, wire::Clock::now() + kKeeperTimeout, what);
  }
  wire::Listing listing() const {
    return wire::decode_listing(ask(wire::Op::List, 0, 0, {}, kListingBytes), what + ": this host's keeper");
  }
};

// The caller's group, the keeper's socket (InvalidArgument naming
// DTRAIN_SNAPSHOT_SOCKET when there is none), and for `bytes` the group
// itself or, for nccl, a tcp companion.
Context context_of(const SnapshotOptions& options, const std::string& what);

struct Staged {
  int64_t step = 0;
  std::string part;     // this rank's part, encoded
  std::string failure;  // why it could not be (the agreement fails every rank then)
};
// Collective over c.group (save()'s plan): runs the state's before_save
// hooks and encodes this rank's part.
Staged stage(const Context& c, int64_t step, const DistributedState& state);
// Collective over c.bytes: keeps the part in this host's keeper and
// another host's, agrees, commits. The same Error on every rank when any
// failed.
SnapshotInfo transfer(const Context& c, Staged staged);

// Waits for `group`'s asynchronous snapshot in flight, if any; throws its
// failure when nobody has seen it yet ("<context>: the snapshot of step
// <s> before it failed: ..."). Every snapshot call runs it first.
void wait_for_async_snapshot(const std::shared_ptr<ProcessGroup>& group, const std::string& context);

}  // namespace dtrain::checkpoint::snapshot_detail
