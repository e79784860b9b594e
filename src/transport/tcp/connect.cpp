// The TCP transport: the mesh of sockets (mesh.cpp) under the engine.

#include <algorithm>

#include "transport/engine/engine.h"
#include "transport/tcp/mesh.h"
#include "transport/tcp/socket_link.h"
#include "transport/tcp/transport.h"

namespace dtrain::transport {

uint64_t tcp::eager_grant(const TcpOptions& options, int size) {
  return engine::eager_grant(options.unexpected_bytes,
                             static_cast<size_t>(std::max(size - 1, 1)) * options.streams);
}

std::unique_ptr<Transport> connect_tcp(Store& store, int rank, int size,
                                       const TcpOptions& options) {
  auto mesh = tcp::connect_mesh(store, rank, size, options);
  engine::Links links;
  links.links.resize(size);
  for (int p = 0; p < size; ++p)
    for (auto& fd : mesh.conns[p])
      links.links[p].push_back(std::make_unique<tcp::SocketLink>(std::move(fd)));
  links.grants = std::move(mesh.grants);
  links.granted = tcp::eager_grant(options, size);
  links.peer_names = std::move(mesh.peer_names);
  for (int s = 0; s < options.streams; ++s)
    links.pollers.push_back(std::make_unique<tcp::EpollPoller>());
  return std::make_unique<engine::Engine>(std::move(links), rank, size,
                                          engine::EngineOptions{options.timeout, options.name, "tcp"});
}

}  // namespace dtrain::transport
