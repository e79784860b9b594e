#pragma once

// Connection setup of the TCP transport (see transport.h): the full mesh of
// `streams` connections per pair of ranks, each opened with a checked hello.

#include <string>
#include <vector>

#include "common/socket.h"
#include "dtrain/store/store.h"
#include "transport/tcp/transport.h"

namespace dtrain::transport::tcp {

struct Mesh {
  // conns[peer][stream]; conns[rank] is empty. Blocking sockets, TCP_NODELAY.
  std::vector<std::vector<net::Fd>> conns;
  std::vector<std::string> peer_names;  // "rank 3 (10.0.0.2:41234)"
};

Mesh connect_mesh(Store& store, int rank, int size, const TcpOptions& options);

}  // namespace dtrain::transport::tcp
