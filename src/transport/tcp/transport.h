#pragma once

// The TCP transport: dtrain's own network path between the ranks of a group
// (the "tcp" backend, "gloo" as its alias, and the links between machines of
// "auto").
//
// Every pair of ranks is joined by `streams` TCP connections (TCP_NODELAY).
// A message of at least kSplitBytes is cut into one part per connection, so
// the kernel's copies for one large message run on several sockets (and
// several I/O threads) at once; smaller ones travel whole on the first.
// Each connection carries frames of a fixed header (magic, tag, total
// bytes) and the payload. One I/O thread per stream index serves that
// stream's connections to every peer through epoll: it reads each payload
// straight into the posted receive buffer, or, when the receive is not
// posted yet, into a held buffer that the receive later copies from.
// Held buffers are bounded by flow control: each connection's receiver
// grants its sender eager credit (unexpected_bytes shared over the
// connections); a part that does not fit the sender's credit is announced
// and sent only once its receive is posted (connection.h).
// Sends are written on the caller's thread while the socket takes them and
// finished by the I/O thread.
//
// Connection setup goes through the store: each rank listens on
// `local_address` (port chosen by the kernel) and publishes host:port; a
// rank connects to every lower rank and accepts from every higher one. Each
// connection opens with a hello (magic, version, the group's random id, rank,
// stream), checked before it is used, and with a job token both ends prove
// they hold it (hello.h); a connection that fails any of it is closed and
// logged, and does not disturb the group.

#include <chrono>
#include <memory>
#include <string>

#include "dtrain/store/store.h"
#include "transport/transport.h"

namespace dtrain::transport {

struct TcpOptions {
  std::string local_address;  // where peers reach this rank; empty: 127.0.0.1
  int streams = 2;            // connections per pair of ranks (1..16)
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};  // connection setup
  std::string name;           // the group's name, for messages
  std::string label = "tcp";  // the first word of its messages ("shm" over rings)
  std::string token;          // the job token (DTRAIN_STORE_TOKEN); empty: none
  // Memory this rank holds at most for messages that arrive before their
  // receive is posted, over all its connections (each gets an equal share,
  // at least kMinEagerBytes); see connection.h for the protocol.
  size_t unexpected_bytes = size_t{64} << 20;
};

// The least eager credit a connection grants, whatever the group's size.
constexpr size_t kMinEagerBytes = 4096;

// Messages at least this long are split over every stream.
constexpr size_t kSplitBytes = 256 * 1024;

// Connects the full mesh (blocking, under options.timeout: TimeoutError
// naming the ranks that did not connect) and starts the I/O threads.
std::unique_ptr<Transport> connect_tcp(Store& store, int rank, int size,
                                       const TcpOptions& options);

}  // namespace dtrain::transport
