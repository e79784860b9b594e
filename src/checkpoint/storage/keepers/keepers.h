#pragma once

// The keepers storage: snapshots in the memory of the hosts' keepers
// (dtrain/checkpoint/snapshot.h). Each rank talks to its own host's keeper
// (keeper.h) over a Unix socket (wire.h); parts travel between hosts over
// the group, on a tag of dtrain's own. The writer keeps each rank's part
// (part.h) in its host's keeper and another host's and commits once every
// part is kept; the reader takes the newest snapshot the keepers hold
// completely.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/storage/keepers/wire.h"
#include "checkpoint/storage/storage.h"
#include "dtrain/distributed.h"

namespace dtrain {
class ProcessGroup;
}

namespace dtrain::checkpoint::storage::keepers {

namespace wire = snapshot_wire;

// The Checkpointer's lane of snapshots, and its companion group's purpose.
constexpr char kLane[] = "snapshot";

// A request to this host's keeper: a few GiB over a Unix socket.
constexpr auto kKeeperTimeout = std::chrono::minutes(5);
constexpr uint64_t kListingBytes = 64 + 12ull * wire::kMaxWorld;

// This rank's host keeper, for one group's snapshots.
struct Keeper {
  std::string socket, what;
  std::string key;  // the group's in its keepers: its name and ranks (wire.h)
  int world = 0;

  std::string ask(wire::Op op, int64_t step, int part_rank, std::string payload = {}, uint64_t max_answer = 0) const;
  wire::Listing listing() const;
};

// This host's keeper's socket: the one given, or DTRAIN_SNAPSHOT_SOCKET
// (InvalidArgument naming it when neither is set).
std::string keeper_socket(const std::string& given, const std::string& what);
// The keeper at `socket` for `group`'s snapshots; `what` starts every
// error ("checkpoint::snapshot of step 7").
Keeper keeper_of(const std::string& socket, const ProcessGroup& group, const std::string& what);

// Collective over the write's group (CPU tensors): the snapshot of `step`.
std::unique_ptr<Writer> writer(int64_t step, Keeper keeper);

// Collective over `group` (CPU tensors): the newest snapshot after
// `newer_than` that the keepers hold completely, each rank its own part;
// nothing when there is none.
class SnapshotReader final : public Reader {
 public:
  SnapshotReader(Keeper keeper, std::shared_ptr<ProcessGroup> group, int64_t newer_than);
  std::optional<Loaded> read(const DistributedState& state) override;
  int64_t step() const { return step_; }  // of the snapshot read

 private:
  Keeper keeper_;
  std::shared_ptr<ProcessGroup> group_;
  int64_t newer_than_, step_ = -1;
};

// ---- shared by the writer and the reader (keepers.cpp) ----------------------

// Every rank's failure text ("" for none): the same error on every rank,
// "<what>: rank <r>: <text>", when any is not empty (E: its type).
template <typename E>
void agree(const std::shared_ptr<ProcessGroup>& group, const std::string& what, const std::string& mine);
// The global rank of `group`'s rank r, for point-to-point calls.
int global_rank(const ProcessGroup& group, int r);
// The options of the parts' messages: dtrain's own tag (issued under
// InternalTraffic), so that a receive the user posted ahead on the group
// cannot take them.
P2POptions part_options(const std::shared_ptr<ProcessGroup>& group);
at::Tensor as_bytes(std::string& s);

}  // namespace dtrain::checkpoint::storage::keepers
