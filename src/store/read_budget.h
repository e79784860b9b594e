#pragma once

// The TCP store server's read budget (TcpStoreServer::Limits::io_budget):
// the bytes held for all connections together, requests arriving and
// replies unsent. A connection whose next read it does not cover waits its
// turn (first come, first served); one with whole requests waits while it
// is spent; and while anyone has waited for stall_timeout, the connection
// that holds most of it without progress is named for closing, so a client
// that never reads its replies, or sends half a request and stops, cannot
// hold the store. Touched by the server's thread only.

#include <chrono>
#include <cstdint>
#include <deque>
#include <vector>

#include "store/io_buffers.h"
#include "store/store_connection.h"

namespace dtrain::store_detail {

class ReadBudget {
 public:
  using Clock = net::Clock;

  explicit ReadBudget(size_t limit) : io_(limit) {}
  // The account the connections' buffers charge.
  IoBudget& io() { return io_; }
  const IoBudget& io() const { return io_; }

  // Whether `c` may read now; if not, it joins the queue of readers.
  bool may_read(uint64_t id, StoreConnection& c);
  // `c` has a whole request but the budget is spent: it waits to be resumed.
  void note_stalled(uint64_t id, StoreConnection& c);
  // Once per turn: the queued readers go on, in order, as far as the budget
  // covers them; once it is not spent, the stalled connections are added
  // to `resume`.
  void wake(StoreConnections& conns, std::vector<uint64_t>& resume);

  bool anyone_waiting() const { return !readers_.empty() || !stalled_.empty(); }
  // When the connections waiting now began to wait (or this was last looked at).
  Clock::time_point waiting_since() const { return since_; }
  // While anyone has waited for `stall_timeout`: the connection holding the
  // most bytes that has neither sent nor read for as long (0: none), and
  // those bytes in `held`. One look per stall_timeout.
  uint64_t stalled_holder(const StoreConnections& conns, std::chrono::milliseconds stall_timeout,
                          size_t& held);

 private:
  bool covers_next_read(StoreConnection& c);
  void start_waiting();

  IoBudget io_;
  std::deque<uint64_t> readers_;   // connections whose input waits for the budget
  std::vector<uint64_t> stalled_;  // connections whose requests wait for it
  Clock::time_point since_{};
};

}  // namespace dtrain::store_detail
