#pragma once

// The rings between the ranks of one machine, as links of the transport
// engine (engine/engine.h): used by the shm transport for a whole group
// and by the topology transport (transport/connect.h) for the ranks that
// share a host. Private to src/transport/.

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/store/store.h"
#include "transport/engine/engine.h"

namespace dtrain::transport {

// Builds one segment of rings among `ranks` (group ranks, ascending, all on
// this machine, `rank` among them) through `store` (its keys under "shm/":
// one store scope per set of ranks), each rank granting `granted` bytes of
// eager credit per ring. Fills links.links, grants and peer_names for those
// peers (and poller_of, when it is in use) and appends the one poller that
// serves them all; returns that poller's index. `name`: the group's, for
// messages.
int add_ring_links(Store& store, int rank, const std::vector<int>& ranks, uint64_t granted,
                   const std::string& name, engine::Links& links);

}  // namespace dtrain::transport
