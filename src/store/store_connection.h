#pragma once

// One client connection of the TCP store's server (tcp_store_server.h): its
// socket, its buffers (held under the server's read budget), and where it
// stands: the job token's handshake, the budget's queues, a parked request.

#include <chrono>
#include <cstdint>
#include <string>
#include <unordered_map>

#include "common/socket.h"
#include "store/auth.h"
#include "store/c10d_wire.h"
#include "store/io_buffers.h"

namespace dtrain::store_detail {

// A read when the size of the request being read is not known yet.
constexpr size_t kReadChunk = 64 * 1024;

struct StoreConnection {
  using Clock = net::Clock;
  // Replies are built only while less than this waits to be sent.
  static constexpr size_t kMaxPendingOutput = 1 << 20;

  explicit StoreConnection(IoBudget* budget) : in(budget), out(budget) {}
  net::Fd fd;
  std::string peer;               // "addr:port" for log lines
  Clock::time_point opened;
  bool established = false;       // has sent a well-formed request (and proved the token)
  bool authenticated = false;     // has proved the job token
  bool challenged = false;        // AUTH_HELLO answered; AUTH_PROOF expected
  store_auth::Nonce client_nonce{}, server_nonce{};
  InputBuffer in;                 // bytes received, not yet handled
  OutputQueue out;                // replies not yet sent
  size_t in_need = 0;             // size the request in `in` has (0: not known yet)
  c10d_wire::Scan scan;           // how far a c10d request in `in` was looked at
  Clock::time_point last_progress;  // last byte received or sent
  bool awaiting_budget = false;   // queued for the read budget: its buffer cannot grow now
  bool budget_granted = false;    // taken off that queue: its next read may go
  bool stalled = false;           // its requests wait for the budget
  bool parked = false;            // a GET/WAIT is waiting; hold later requests
  bool broken = false;            // to be closed at the end of this turn
  c10d_wire::Dialect dialect = c10d_wire::Dialect::kUnknown;
  size_t pending_output() const { return out.pending(); }
  // Requests are neither handled nor read while this is true.
  bool blocked() const { return parked || pending_output() >= kMaxPendingOutput; }
};

using StoreConnections = std::unordered_map<uint64_t, StoreConnection>;

}  // namespace dtrain::store_detail
