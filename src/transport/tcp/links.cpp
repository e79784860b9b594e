#include "transport/tcp/links.h"

#include "transport/tcp/mesh.h"
#include "transport/tcp/socket_link.h"

namespace dtrain::transport::tcp {

void add_socket_links(Store& store, int rank, const TcpOptions& options,
                      const std::vector<bool>& peers, uint64_t granted, int threads,
                      engine::Links& links) {
  const int size = static_cast<int>(peers.size());
  MeshScope scope;
  scope.peers = peers;
  scope.grant = granted;
  auto mesh = connect_mesh(store, rank, size, options, scope);
  const int first = static_cast<int>(links.pollers.size());
  for (int s = 0; s < threads; ++s) links.pollers.push_back(std::make_unique<EpollPoller>());
  for (int p = 0; p < size; ++p) {
    if (!peers[p]) continue;
    for (int s = 0; s < options.streams; ++s) {
      links.links[p].push_back(std::make_unique<SocketLink>(std::move(mesh.conns[p][s])));
      links.poller_of[p].push_back(first + s % threads);
    }
    links.grants[p] = std::move(mesh.grants[p]);
    links.peer_names[p] = std::move(mesh.peer_names[p]);
  }
}

}  // namespace dtrain::transport::tcp
