#include "transport/connect.h"

#include "common/enforce.h"
#include "dtrain/store/prefix_store.h"
#include "transport/shm/ring_mesh.h"
#include "transport/tcp/mesh.h"
#include "transport/tcp/socket_link.h"
#include "transport/engine/engine.h"

namespace dtrain::transport {

std::unique_ptr<Transport> connect_topology(Store& store, int rank, const Topology& topology,
                                            const TcpOptions& options) {
  const int size = topology.size();
  const int host = topology.host_of[rank];
  const auto& local = topology.hosts[host];
  tcp::MeshScope scope;
  scope.peers.resize(size);
  size_t remote = 0;
  for (int p = 0; p < size; ++p) {
    scope.peers[p] = p != rank && !topology.same_host(p, rank);
    remote += scope.peers[p] ? 1 : 0;
  }
  const size_t connections = local.size() - 1 + remote * options.streams;
  engine::Links links;
  links.granted = engine::eager_grant(options.unexpected_bytes, connections);
  links.links.resize(size);
  links.grants.resize(size);
  links.peer_names.resize(size);
  links.poller_of.resize(size);
  links.labels.assign(size, "tcp");
  for (int p : local) links.labels[p] = "shm";
  if (local.size() > 1) {
    // The rings of this host, in a store scope of its own.
    PrefixStore scoped(detail::cat("host", host), std::shared_ptr<Store>(&store, [](Store*) {}));
    add_ring_links(scoped, rank, local, links.granted, options.name, links);
  }
  if (remote > 0) {
    scope.grant = links.granted;
    auto mesh = tcp::connect_mesh(store, rank, size, options, scope);
    // One I/O thread per stream, as on tcp, unless this host's rings have
    // theirs: then one serves every stream. The network phases run on every
    // rank of the host at once (two_level.cpp), each on its own I/O thread,
    // so the host's cores carry them still; and a rank keeps 4 threads
    // (collectives, send/recv completion, rings, TCP) at any stream count.
    const int first = static_cast<int>(links.pollers.size());
    const int tcp_threads = links.pollers.empty() ? options.streams : 1;
    for (int s = 0; s < tcp_threads; ++s)
      links.pollers.push_back(std::make_unique<tcp::EpollPoller>());
    for (int p = 0; p < size; ++p) {
      if (!scope.peers[p]) continue;
      for (int s = 0; s < options.streams; ++s) {
        links.links[p].push_back(std::make_unique<tcp::SocketLink>(std::move(mesh.conns[p][s])));
        links.poller_of[p].push_back(first + s % tcp_threads);
      }
      links.grants[p] = std::move(mesh.grants[p]);
      links.peer_names[p] = std::move(mesh.peer_names[p]);
    }
  }
  return std::make_unique<engine::Engine>(
      std::move(links), rank, size, engine::EngineOptions{options.timeout, options.name, "auto"});
}

}  // namespace dtrain::transport
