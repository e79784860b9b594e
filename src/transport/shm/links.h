#pragma once

// The shared-memory carrier as links of the transport engine
// (engine/engine.h): byte rings between the ranks of one host, what the
// fabric (transport/fabric.h) calls for the peers it gives to shared
// memory. The same frame protocol as over sockets; a peer that dies is
// noticed within about 0.1 s. Private to src/transport/.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/store/store.h"
#include "transport/engine/engine.h"

namespace dtrain::shm {

// Builds one segment of rings among `ranks` (group ranks, ascending, all on
// this machine, `rank` among them; else BackendUnavailable on every rank)
// through `store` (its keys under "shm/": one store scope per set of
// ranks), each rank granting `granted` bytes of eager credit per ring.
// Fills links.links, grants, peer_names and poller_of for those peers and
// appends the one poller that serves them all. `name`: the group's, for
// messages.
void add_ring_links(Store& store, int rank, const std::vector<int>& ranks, uint64_t granted,
                    const std::string& name, transport::engine::Links& links);

// The bytes of each ring among `ranks` ranks: 32 MiB over the rings, a
// power of two from 16 KiB to 1 MiB.
size_t ring_bytes(int ranks);

}  // namespace dtrain::shm
