#pragma once

// A group's data plane (no torch here): one transport that reaches every
// peer, and the shared memory of this rank's host.
//
// Each pair of ranks is joined by the first carrier of a table that can
// join it, as NCCL picks a transport per peer (selectTransport): byte rings
// in shared memory between ranks of one host (shm/links.h), TCP sockets
// between any two (tcp/links.h). All of them run under the one engine
// (engine/engine.h): the same frame protocol, per-request completion and
// failure policy whatever carries the bytes. Where several ranks share a
// host, the fabric also maps that host's slots (shm/slots.h), which the
// in-place shared-memory collectives read (algorithms/slots.h): the whole
// group's on one host, the inside-host phases of the two-level ones on
// several.
//
// Backends tcp, shm and auto are this one fabric over three topologies:
// every rank a host of its own, one host, and the discovered one.
//
// Threads: one I/O thread per host's rings, and per TCP stream (one for
// every stream when the host has rings too: the ranks of a host carry the
// network side by side, each on its own thread).

#include <memory>
#include <string>

#include "dtrain/store/store.h"
#include "transport/tcp/options.h"
#include "transport/topology.h"
#include "transport/transport.h"

namespace dtrain::shm {
class Slots;
}

namespace dtrain::transport {

struct FabricOptions {
  // The sockets' options; its name, timeout (setup), unexpected_bytes
  // (eager credit, shared over all of a rank's links) and
  // unexpected_messages serve every carrier.
  TcpOptions tcp;
  // Map the slots of each host that holds several of the group's ranks.
  bool host_slots = false;
  // The first word of the transport's messages ("tcp", "shm", "auto").
  std::string label = "tcp";
};

struct Fabric {
  std::unique_ptr<Transport> transport;
  // This host's slots, its ranks in topology order; null when this rank is
  // alone on its host or options.host_slots is off.
  std::shared_ptr<shm::Slots> host_slots;
};

// Connects every rank of `topology` (blocking, under options.tcp.timeout).
// Uses the store's keys under "tcp/" and "host<i>/": give it a store scoped
// to the group.
Fabric connect(Store& store, int rank, const Topology& topology, const FabricOptions& options);

}  // namespace dtrain::transport
