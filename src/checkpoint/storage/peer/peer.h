#pragma once

// A live peer as a storage: one rank's whole state, sent over a process
// group to a rank of the same layout, which reads it as a Reader
// (storage.h). Fault tolerance heals a replica that comes back this way
// (dtrain/ft/manager.h): no disk, no keeper, the part's checksums checked
// before anything is written into the state.
//
// What moves is the rank's part as a snapshot part (storage/part.h) holding
// every replicated entry and every sharded piece of the state, its
// metadata, and the step it was taken at: first its size (one int64),
// then its bytes (uint8), both on `tag`.

#include <cstdint>
#include <string>

#include "checkpoint/storage/storage.h"

namespace dtrain::checkpoint::storage::peer {

// Runs the state's before_save hooks, then sends the part to `dst` (a rank
// of `group`), blocking until it is sent. `rank`/`world`: the sender's
// place in its own layout (the receiver must hold the same place).
void send_state(const DistributedState& state, int64_t step, int rank, int world, ProcessGroup& group,
                int dst, int tag);

// The part send_state sent from `src`, checked against the state of the
// same place: its size before it is received (at most what the state's
// tensors and metadata need, plus room for the part's own headers), then
// the step, the place, every entry's shape and dtype and the checksums.
// InvalidArgument "<what>: ..." naming what differs.
class Reader : public storage::Reader {
 public:
  Reader(ProcessGroup& group, int src, int tag, int64_t step, int rank, int world, std::string what);
  std::optional<Loaded> read(const DistributedState& state) override;

 private:
  ProcessGroup& group_;
  int src_, tag_;
  int64_t step_;
  int rank_, world_;
  std::string what_;
};

}  // namespace dtrain::checkpoint::storage::peer
