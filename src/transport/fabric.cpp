#include "transport/fabric.h"

#include "common/enforce.h"
#include "dtrain/store/prefix_store.h"
#include "transport/engine/engine.h"
#include "transport/shm/links.h"
#include "transport/shm/slots.h"
#include "transport/tcp/links.h"

namespace dtrain::transport {
namespace {

// What a carrier sees of the fabric being built.
struct Build {
  Store& store;
  int rank;
  const Topology& topology;
  const FabricOptions& options;
  engine::Links& links;
};

// The store scope of this rank's host: its rings and slots.
std::shared_ptr<Store> host_scope(const Build& b) {
  return std::make_shared<PrefixStore>(detail::cat("host", b.topology.host_of[b.rank]),
                                       std::shared_ptr<Store>(&b.store, [](Store*) {}));
}

// A carrier of bytes between two ranks, and how its links are made.
struct Carrier {
  const char* name;
  // Whether it can join ranks a and b (the same answer on both).
  bool (*can_connect)(const Topology& topology, int a, int b);
  // Links per peer it makes (each takes a share of the eager credit).
  int (*links_per_peer)(const FabricOptions& options);
  // Makes the links to `peers` ([rank]: those it was picked for), each
  // granting `granted` bytes of eager credit.
  void (*add)(const Build& b, const std::vector<bool>& peers, uint64_t granted);
};

void add_rings(const Build& b, const std::vector<bool>& peers, uint64_t granted) {
  std::vector<int> ranks;
  for (int p = 0; p < static_cast<int>(peers.size()); ++p)
    if (peers[p] || p == b.rank) ranks.push_back(p);
  auto scope = host_scope(b);
  shm::add_ring_links(*scope, b.rank, ranks, granted, b.options.tcp.name, b.links);
}

void add_sockets(const Build& b, const std::vector<bool>& peers, uint64_t granted) {
  // One I/O thread per stream, unless this host's rings have theirs: then
  // one serves every stream. The network phases run on every rank of the
  // host at once (algorithms/two_level.cpp), each on its own I/O thread, so
  // the host's cores carry them still, and a rank keeps 4 threads
  // (collectives, send/recv completion, rings, TCP) at any stream count.
  const int threads = b.links.pollers.empty() ? b.options.tcp.streams : 1;
  tcp::add_socket_links(b.store, b.rank, b.options.tcp, peers, granted, threads, b.links);
}

// In order of preference: the first that can join a pair carries it.
constexpr Carrier kCarriers[] = {
    {"shm", [](const Topology& t, int a, int b) { return t.same_host(a, b); },
     [](const FabricOptions&) { return 1; }, add_rings},
    {"tcp", [](const Topology&, int, int) { return true; },
     [](const FabricOptions& o) { return o.tcp.streams; }, add_sockets},
};
constexpr int kCarrierCount = static_cast<int>(sizeof(kCarriers) / sizeof(kCarriers[0]));

}  // namespace

Fabric connect(Store& store, int rank, const Topology& topology, const FabricOptions& options) {
  const int size = topology.size();
  DTRAIN_ENFORCE(rank >= 0 && rank < size);
  // Each peer's carrier, and the links this rank grants credit over.
  std::vector<int> carrier_of(size, -1);
  size_t connections = 0;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    int c = 0;
    while (!kCarriers[c].can_connect(topology, rank, p)) ++c;
    carrier_of[p] = c;
    connections += static_cast<size_t>(kCarriers[c].links_per_peer(options));
  }
  engine::Links links;
  links.granted = engine::eager_grant(options.tcp.unexpected_bytes, std::max<size_t>(connections, 1));
  links.links.resize(size);
  links.grants.resize(size);
  links.peer_names.resize(size);
  links.poller_of.resize(size);
  links.labels.resize(size);
  for (int p = 0; p < size; ++p)
    if (p != rank) links.labels[p] = kCarriers[carrier_of[p]].name;

  Fabric fabric;
  const Build build{store, rank, topology, options, links};
  const auto& host = topology.hosts[topology.host_of[rank]];
  if (options.host_slots && host.size() > 1) {
    auto scope = host_scope(build);
    PrefixStore slots_scope("slots", scope);
    fabric.host_slots = std::make_shared<shm::Slots>(slots_scope, topology.local_index[rank],
                                                     static_cast<int>(host.size()),
                                                     options.tcp.name);
  }
  // Carrier by carrier, in the table's order on every rank: each one's
  // setup meets only the peers it was picked for.
  for (int c = 0; c < kCarrierCount; ++c) {
    std::vector<bool> peers(size, false);
    bool any = false;
    for (int p = 0; p < size; ++p) any |= peers[p] = carrier_of[p] == c;
    if (any) kCarriers[c].add(build, peers, links.granted);
  }
  fabric.transport = std::make_unique<engine::Engine>(
      std::move(links), rank, size,
      engine::EngineOptions{options.tcp.timeout, options.tcp.name, options.label,
                            options.tcp.unexpected_messages});
  return fabric;
}

}  // namespace dtrain::transport
