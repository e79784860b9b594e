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
//  - At most kMaxConnections clients are served; further connections are
//    accepted and closed at once.
//  - The destructor stops the thread and closes every socket before it
//    returns, so clients waiting on this server see their connection close.

#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/socket.h"
#include "store/c10d_wire.h"
#include "store/wire.h"

namespace dtrain {

class TcpStoreServer {
 public:
  static constexpr size_t kMaxConnections = 4096;

  TcpStoreServer(const std::string& host, uint16_t port);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  uint16_t port() const { return port_; }
  // The address the listening socket is bound to, as getsockname() reports
  // it (numeric, without the port).
  std::string bound_address() const;
  // Requests parked right now (GET/WAIT whose keys are missing); for tests.
  size_t parked_requests() const { return parked_count_.load(); }

 private:
  using Clock = net::Clock;

  struct Connection {
    net::Fd fd;
    std::string peer;               // "addr:port" for log lines
    std::vector<uint8_t> in;        // bytes received, not yet handled
    std::vector<uint8_t> out;       // reply bytes not yet sent
    size_t out_sent = 0;            // prefix of `out` already sent
    bool parked = false;            // a GET/WAIT is waiting; hold later requests
    c10d_wire::Dialect dialect = c10d_wire::Dialect::kUnknown;
  };

  struct Waiter {
    enum Kind : uint8_t { kGet, kWait, kC10dWait };
    uint64_t conn;
    uint32_t request_id;
    Kind kind;                      // GET replies with the value, WAIT with OK
    std::vector<std::string> keys;
    Clock::time_point deadline;
  };

  void run();
  int poll_timeout_ms() const;
  void accept_clients();
  // Each returns false when the connection must be closed.
  bool read_from(uint64_t id, Connection& c);
  bool process_input(uint64_t id, Connection& c);
  bool handle(uint64_t id, Connection& c, const wire::Header& h, wire::Reader& r);
  bool process_c10d(uint64_t id, Connection& c);
  bool handle_c10d(uint64_t id, Connection& c, c10d_wire::Op op, c10d_wire::Reader& r);
  void c10d_store_values(c10d_wire::Op op, c10d_wire::Reader& r);
  void c10d_wait(uint64_t id, c10d_wire::Reader& r, c10d_wire::Writer& out);
  bool flush(Connection& c);
  void reply(Connection& c, std::vector<uint8_t> frame);
  template <typename Step>
  void serve(uint64_t id, Step step);
  void close_connection(uint64_t id);
  template <typename Pred>
  std::vector<Waiter> take_waiters(Pred pred);
  void key_added();
  void expire_waiters();
  void finish_waiter(const Waiter& w, bool timed_out);

  std::string where_;               // "host:port" for log lines
  uint16_t port_ = 0;
  net::Fd listener_;
  net::Fd wakeup_;                  // eventfd written by the destructor
  std::atomic<bool> stop_{false};
  std::atomic<size_t> parked_count_{0};
  std::thread thread_;

  // Everything below is touched by the server thread only.
  std::map<std::string, std::vector<uint8_t>> data_;
  std::unordered_map<uint64_t, Connection> conns_;
  std::vector<Waiter> waiters_;
  std::vector<uint64_t> resume_;    // connections unparked, with input to process
  uint64_t next_conn_id_ = 1;
  Clock::time_point accept_paused_until_{};
};

}  // namespace dtrain
