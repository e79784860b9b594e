#pragma once

// The TCP store's server: owns the key-value map and answers every client
// from one background thread (a poll() loop over non-blocking sockets).
//
// Contract:
//  - The constructor binds host:port (port 0 = a free port, see port()) and
//    starts the thread; a port in use throws NetworkError at once.
//  - Each connection speaks dtrain's protocol or PyTorch's c10d TCPStore
//    protocol (v1: PyTorch 1.13/2.0, v2: 2.2 and newer), told apart by its
//    first bytes, so PyTorch programs can use this store as torchrun's
//    agent store (store/c10d_wire.h). Both see the same keys.
//  - A client that sends a frame the protocol does not allow (bad magic,
//    version or opcode, a declared length over TcpStore::kMaxFrameBytes, or
//    a payload whose fields overrun it) is disconnected; nothing is
//    allocated for the declared length, and other clients are unaffected.
//  - GET and WAIT never block the thread: the request is parked until its
//    keys exist (reply OK) or its deadline passes (reply TIMEOUT).
//  - Resources are bounded whatever clients send (docs/security.md):
//    a connection's replies are built only while its unsent output is
//    under kMaxPendingOutput, and its socket is not read while it is
//    blocked (output backed up, or a GET/WAIT parked), so no request
//    sequence makes replies or requests pile up; the bytes held for all
//    connections together (requests arriving, replies unsent; a GET's
//    reply shares the stored value) stay within Limits::io_budget: when it
//    is spent the server stops reading and handling rather than allocate,
//    and a connection that holds part of it without sending or reading
//    for Limits::stall_timeout while others wait is closed, with a log
//    line (store/io_buffers.h); stored bytes and keys are
//    capped (Limits; a request that would pass a cap gets an error naming
//    it); a request names at most kMaxKeysPerRequest keys; a connection
//    has at most kMaxWaitsPerConnection parked waits.
//  - Connections: without a job token, at most Limits::max_connections
//    established ones (a connection is established by its first
//    well-formed request; 4,096, or twice WORLD_SIZE and 64 when that is
//    more); further ones are closed at once. With a token, connections
//    that proved it are not capped. Connections that have not sent a
//    well-formed request within Limits::handshake_timeout (10 s) are
//    closed, and at most max(kMaxPending, max_connections) of them are
//    kept (the oldest one that has sent nothing goes), so neither idle
//    strangers nor a burst of thousands of ranks connecting at once lock
//    a job's own ranks out, and established ones are never taken.
//  - The destructor stops the thread and closes every socket before it
//    returns, so clients waiting on this server see their connection close.
//
// This class is the loop over the sockets: accepting and admitting
// connections, reading requests and cutting them into frames in either
// dialect, the job token's handshake (token_handshake.h), sending replies,
// and closing connections. What the requests do, and the keys and parked
// requests they act on, are the store service's (store_service.h). Its
// other parts: a client's connection (store_connection.h) and the read
// budget (read_budget.h).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/socket.h"
#include "store/c10d_wire.h"
#include "store/io_buffers.h"
#include "store/read_budget.h"
#include "store/store_connection.h"
#include "store/store_service.h"
#include "store/store_util.h"
#include "store/wire.h"

namespace dtrain {

class TcpStoreServer : private store_detail::StoreService::Connections {
 public:
  static constexpr size_t kMaxConnections = 4096;
  static constexpr size_t kMaxPending = 256;
  static constexpr size_t kMaxPendingOutput = store_detail::StoreConnection::kMaxPendingOutput;
  static constexpr size_t kMaxWaitsPerConnection = store_detail::StoreService::kMaxWaitsPerConnection;
  static constexpr size_t kMaxKeysPerRequest = store_detail::StoreService::kMaxKeysPerRequest;

  // Caps on what the store holds; the defaults come from
  // DTRAIN_STORE_MAX_BYTES and DTRAIN_STORE_MAX_KEYS.
  struct Limits {
    uint64_t max_bytes = 1ull << 30;  // keys plus values
    uint64_t max_keys = 1 << 20;
    // A connection that sends no well-formed request in this time is closed.
    std::chrono::milliseconds handshake_timeout{10000};
    // Bytes held for all connections together (requests arriving, replies
    // unsent), and how long a connection may hold some of them without
    // progress while others wait for them.
    size_t io_budget = size_t(256) << 20;
    std::chrono::milliseconds stall_timeout{10000};
    // Established connections without a job token (see above).
    size_t max_connections = kMaxConnections;
    static Limits from_environment();
  };

  // With a token, every connection must prove it holds it before anything
  // else is served (store/auth.h); c10d clients, which cannot, are refused.
  TcpStoreServer(const std::string& host, uint16_t port,
                 Limits limits = Limits::from_environment(),
                 std::optional<std::string> token = std::nullopt);
  ~TcpStoreServer() override;
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  uint16_t port() const { return port_; }
  // The address the listening socket is bound to, as getsockname() reports
  // it (numeric, without the port).
  std::string bound_address() const;
  // Requests parked right now (GET/WAIT whose keys are missing) and
  // connections open; for tests.
  size_t parked_requests() const { return service_.parked(); }
  size_t connections() const { return conn_count_.load(); }
  // The most reply bytes one connection has had waiting to be sent.
  size_t peak_pending_output() const { return peak_output_.load(); }
  // The most bytes held for all connections at once (Limits::io_budget).
  size_t peak_buffered() const { return peak_buffered_.load(); }

 private:
  using Clock = net::Clock;

  using Connection = store_detail::StoreConnection;

  void run();
  int poll_timeout_ms() const;
  void accept_clients();
  // Each returns false when the connection must be closed.
  bool read_from(uint64_t id, Connection& c);
  bool process_input(uint64_t id, Connection& c);
  bool process_c10d(uint64_t id, Connection& c);
  bool flush(Connection& c);
  // Queues a reply; `value`, if given, is sent from the table's copy.
  void queue_reply(Connection& c, std::vector<uint8_t> head,
                   store_detail::SharedValue value = nullptr);
  // StoreService::Connections.
  void reply(uint64_t id, std::vector<uint8_t> head, store_detail::SharedValue value) override;
  void park(uint64_t id) override;
  void answer_parked(uint64_t id, std::vector<uint8_t> head, store_detail::SharedValue value,
                     bool unpark) override;
  void close_stalled_holder();
  template <typename Step>
  void serve(uint64_t id, Step step);
  void close_connection(uint64_t id);
  void say_why(Connection& c, uint32_t request_id, const std::string& why);
  bool authenticate(Connection& c, const wire::Header& h, wire::Reader& r);
  void refuse(const Connection& c, const std::string& why);
  void doom(uint64_t id, Connection& c);
  void close_stale_connections();
  size_t max_pending() const;
  void make_room_for_pending();
  void mark_established(uint64_t id, Connection& c);

  std::string where_;               // "host:port" for log lines
  uint16_t port_ = 0;
  Limits limits_;
  std::optional<std::string> token_;
  net::Fd listener_;
  net::Fd wakeup_;                  // eventfd written by the destructor
  std::atomic<bool> stop_{false};
  std::atomic<size_t> conn_count_{0};
  std::atomic<size_t> peak_output_{0};
  std::atomic<size_t> peak_buffered_{0};
  std::thread thread_;

  // Everything below is touched by the server thread only.
  store_detail::StoreService service_;
  store_detail::ReadBudget budget_;  // before conns_, whose buffers it counts
  store_detail::StoreConnections conns_;
  size_t established_ = 0;
  std::map<uint64_t, Clock::time_point> pending_;  // not established: id -> opened
  std::vector<uint64_t> resume_;    // connections unblocked, with input to process
  std::vector<uint64_t> doomed_;    // connections to close at the end of the turn
  uint64_t next_conn_id_ = 1;
  Clock::time_point accept_paused_until_{};
  Clock::time_point last_refusal_log_{};
  size_t refusals_unlogged_ = 0;
};

}  // namespace dtrain
