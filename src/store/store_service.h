#pragma once

// What the TCP store's requests do, apart from the sockets that carry them
// (tcp_store_server.h owns those): the keys (key_value_table.h) and the
// requests parked on missing keys (waiter_table.h), answered in dtrain's
// protocol (store/wire.h; store_service.cpp) and in PyTorch's c10d one
// (store/c10d_wire.h; store_service_c10d.cpp), which see the same keys.
//
// A request comes in parsed as far as its frame (a wire::Reader over its
// payload) from the connection with id `conn`. Its answer goes out through
// Connections: to `conn` itself, and, where a request stores a key that
// parked requests of other connections waited for, to those too. A GET or
// WAIT whose keys are missing parks its connection (no later request of it
// is handled before the answer, which keeps replies in order); a c10d WAIT
// does not (its client may CANCEL_WAIT meanwhile).
//
// One thread at a time (the server's), except parked(), which any thread
// may read.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "store/c10d_wire.h"
#include "store/key_value_table.h"
#include "store/store_util.h"
#include "store/waiter_table.h"
#include "store/wire.h"

namespace dtrain::store_detail {

class StoreService {
 public:
  using Clock = WaiterTable::Clock;
  static constexpr size_t kMaxKeysPerRequest = 128 * 1024;
  static constexpr size_t kMaxWaitsPerConnection = 64;
  // SET_EPHEMERAL: keys a connection may hold tied to its life.
  static constexpr size_t kMaxEphemeralPerConnection = 64;

  // Where answers go: the server's connections.
  class Connections {
   public:
    virtual ~Connections() = default;
    // Queues `head` (then `value`, sent from the table's copy, if given) on
    // connection `conn`: an answer to the request being handled.
    virtual void reply(uint64_t conn, std::vector<uint8_t> head, SharedValue value) = 0;
    // Marks `conn` parked: its later requests wait for this one's answer.
    virtual void park(uint64_t conn) = 0;
    // The answer to a parked request, sent at once; `unpark` lets `conn`
    // go on with the requests queued behind it. A connection that is gone
    // or closing gets nothing.
    virtual void answer_parked(uint64_t conn, std::vector<uint8_t> head, SharedValue value,
                               bool unpark) = 0;
  };

  // `has_token`: the server requires a job token (for the error that a
  // second AUTH_HELLO gets).
  StoreService(uint64_t max_bytes, uint64_t max_keys, bool has_token, Connections& connections)
      : table_(max_bytes, max_keys), has_token_(has_token), connections_(connections) {}

  // Answers one dtrain request. A well-formed request the store must
  // refuse (a key over the size limit, add() on a non-integer) gets an
  // ERROR reply that the client throws as InvalidArgument; a malformed one
  // throws wire::Malformed.
  void handle(uint64_t conn, const wire::Header& h, wire::Reader& r);
  // Answers one c10d request whose query byte `r` has consumed; false for
  // one dtrain's store does not support (the client is dropped). Throws
  // c10d_wire::Incomplete (nothing changed yet: every field is read before
  // the table is touched), wire::Malformed, or InvalidArgument (add() on a
  // non-integer, which PyTorch's server drops the client for too).
  bool handle_c10d(uint64_t conn, c10d_wire::Op op, c10d_wire::Reader& r);

  // Answers with TIMEOUT every parked request whose deadline has passed.
  void expire(Clock::time_point now);
  // Forgets the parked requests of a connection that closed, and deletes
  // the keys it set with SET_EPHEMERAL (those not set or deleted since).
  void drop_connection(uint64_t conn);
  // The nearest deadline of a parked request, or Clock::time_point::max().
  Clock::time_point next_deadline() const { return waiters_.next_deadline(); }
  size_t parked() const { return parked_.load(); }

 private:
  using Waiter = WaiterTable::Waiter;

  void reply(uint64_t conn, std::vector<uint8_t> head, SharedValue value = nullptr) {
    connections_.reply(conn, std::move(head), std::move(value));
  }
  // A dtrain reply whose payload is the stored `value`.
  void reply_value(uint64_t conn, uint16_t status, uint32_t request_id, SharedValue value);
  void lookup(uint64_t conn, const wire::Header& h, wire::Reader& r);
  void c10d_store_values(c10d_wire::Op op, c10d_wire::Reader& r);
  void c10d_wait(uint64_t conn, c10d_wire::Reader& r, c10d_wire::Writer& out);
  int64_t add(const std::string& key, int64_t delta);
  SharedValue compare_set(const std::string& key, const Bytes& expected, const Bytes& desired);
  void park(Waiter w);
  void key_added(const std::string& key);
  void finish(const Waiter& w, bool timed_out);
  void count_parked() { parked_ = waiters_.size(); }
  void set_ephemeral(uint64_t conn, const std::string& key, Bytes value);
  void untie(const std::string& key);

  KeyValueTable table_;
  WaiterTable waiters_;
  // SET_EPHEMERAL's keys by connection, and each such key's connection.
  std::unordered_map<uint64_t, std::set<std::string>> ephemeral_;
  std::unordered_map<std::string, uint64_t> owner_;
  bool has_token_;
  Connections& connections_;
  std::atomic<size_t> parked_{0};
};

}  // namespace dtrain::store_detail
