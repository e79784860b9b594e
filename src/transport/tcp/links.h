#pragma once

// The TCP carrier as links of the transport engine (engine/engine.h): what
// the fabric (transport/fabric.h) calls for the peers it gives to sockets.
// Private to src/transport/.

#include <vector>

#include "dtrain/store/store.h"
#include "transport/engine/engine.h"
#include "transport/tcp/options.h"

namespace dtrain::transport::tcp {

// Connects this rank to every rank p with peers[p] set (the same relation
// on every rank; blocking, under options.timeout: TimeoutError naming the
// ranks that did not connect), `options.streams` connections each, every
// connection granting `granted` bytes of eager credit. Fills links.links,
// grants, peer_names and poller_of for those peers, served by `threads`
// new pollers (stream s by the (s % threads)-th). Uses the store's keys
// under "tcp/".
void add_socket_links(Store& store, int rank, const TcpOptions& options,
                      const std::vector<bool>& peers, uint64_t granted, int threads,
                      engine::Links& links);

}  // namespace dtrain::transport::tcp
