#pragma once

// One transport for a group whose ranks may span hosts (backend auto): each
// pair of ranks on one host is joined by a ring in shared memory
// (shm/ring_link.h), each pair on different hosts by TCP connections
// (tcp/transport.h), all under the one engine (engine/engine.h): the
// same frame protocol, per-request completion and failure policy whatever
// carries the bytes. Threads: one I/O thread for the rings, one per TCP
// stream. No torch here.

#include <memory>

#include "dtrain/store/store.h"
#include "transport/tcp/transport.h"
#include "transport/topology.h"

namespace dtrain::transport {

// `options` as for connect_tcp (its streams are the TCP connections per
// pair on different hosts; its unexpected_bytes are shared over the rings
// and the connections). Uses the store's keys under "tcp/", "shm/" and
// "host<i>/": give it a store scoped to the group.
std::unique_ptr<Transport> connect_topology(Store& store, int rank, const Topology& topology,
                                            const TcpOptions& options);

}  // namespace dtrain::transport
