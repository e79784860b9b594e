#pragma once

// Backend "shm": every operation on CPU tensors between the ranks of one
// machine, through shared memory only (see docs/backends.md). It is the
// fabric's group (backends/fabric/backend.h) over the topology of one host:
// send/recv over byte rings (transport/shm/), collectives in the host's
// slots (algorithms/slots.h), which read peers' data in place. No socket
// between the ranks.
//
// Collectives run in issue order on the group's thread. Every collective
// first checks, inside the segment and at no extra synchronization, that all
// ranks called the same operation on the same sizes and dtype: a mismatch is
// a CollectiveMismatch on every rank and leaves the group usable. A timeout
// or a dead peer breaks the group: later calls fail at once with that error.

#include <memory>

#include "dtrain/process_group.h"
#include "dtrain/store/store.h"

namespace dtrain::shm_backend {

// BackendUnavailable on every rank when the ranks are not on one machine,
// or when DTRAIN_SHM_DISABLE=1.
std::shared_ptr<ProcessGroup> create_shm_group(std::shared_ptr<Store> store, int rank, int size,
                                               const GroupOptions& options);

}  // namespace dtrain::shm_backend
