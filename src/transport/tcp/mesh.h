#pragma once

// Connection setup of the TCP carrier (see options.h): the full mesh of
// `streams` connections per pair of ranks, each opened with a checked hello.

#include <string>
#include <vector>

#include "common/socket.h"
#include "dtrain/store/store.h"
#include "transport/tcp/options.h"

namespace dtrain::transport::tcp {

struct Mesh {
  // conns[peer][stream]; conns[rank] is empty. Blocking sockets, TCP_NODELAY.
  std::vector<std::vector<net::Fd>> conns;
  std::vector<std::vector<uint64_t>> grants;  // [peer][stream]: eager credit it granted, bytes
  std::vector<std::string> peer_names;  // "rank 3 (10.0.0.2:41234)"
};

// Which connections a rank opens: by default all of them. Tests stand in
// for many light peers with `lower` = 1, `higher` = false (each joins rank 0
// only), so that rank 0 of a large group meets all its peers in one process.
// A group whose hosts share memory inside (auto) connects only the ranks
// of other hosts: `peers` says which ([rank]; empty: every other rank), the
// same relation on every rank, and `grant` is the credit each connection
// grants when the budget is shared with other links too.
struct MeshScope {
  int lower = -1;      // join ranks [0, lower); -1: every lower rank
  bool higher = true;  // accept every higher rank
  std::vector<bool> peers;
  uint64_t grant = 0;  // 0: unexpected_bytes shared over every connection
  bool wants(int peer) const { return peers.empty() || peers[peer]; }
};

// Joins every lower rank and accepts every higher one at the same time, in
// one event loop, so that each handshake completes as soon as both ends have
// spoken (no chain through the ranks). Throws TimeoutError naming the ranks
// still missing at options.timeout, NetworkError for a refusal it was told
// the reason of.
Mesh connect_mesh(Store& store, int rank, int size, const TcpOptions& options,
                  const MeshScope& scope = {});

}  // namespace dtrain::transport::tcp
