#pragma once

// The TCP carrier: dtrain's own network path between ranks (every pair of
// a "tcp" group, "gloo" as its alias, and the pairs on different machines
// of "auto"): links of the transport engine (engine/engine.h: frames, eager
// credit and rendezvous, per-request completion) over TCP sockets, which
// the fabric (transport/fabric.h) picks for every pair on different hosts.
//
// Every pair of ranks is joined by `streams` TCP connections (TCP_NODELAY),
// over which large messages are split; one I/O thread per stream index
// serves that stream's connections to every peer through epoll.
//
// Connection setup goes through the store: each rank listens on
// `local_address` (port chosen by the kernel) and publishes host:port; a
// rank connects to every lower rank and accepts from every higher one. Each
// connection opens with a hello (magic, version, the group's random id, rank,
// stream), checked before it is used, and with a job token both ends prove
// they hold it (hello.h); a connection that fails any of it is closed and
// logged, and does not disturb the group.

#include <chrono>
#include <cstddef>
#include <string>

namespace dtrain::transport {

struct TcpOptions {
  std::string local_address;  // where peers reach this rank; empty: 127.0.0.1
  int streams = 2;            // connections per pair of ranks (1..16)
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};  // connection setup
  std::string name;           // the group's name, for messages
  std::string token;          // the job token (DTRAIN_STORE_TOKEN); empty: none
  // Memory this rank holds at most for messages that arrive before their
  // receive is posted, over all its connections (each gets an equal share,
  // at least 4 KiB); see engine/connection.h for the protocol.
  size_t unexpected_bytes = size_t{64} << 20;
  // Messages announced (too large for the credit left) that this rank holds
  // before their receive is posted, over all its connections: about 256
  // bytes each. A peer that announces more fails the group.
  size_t unexpected_messages = 65536;
};

}  // namespace dtrain::transport
