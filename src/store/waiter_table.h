#pragma once

// The TCP store server's parked requests (a GET or WAIT whose keys are not
// all stored yet), indexed by the keys they still miss and by deadline.
// A new key costs work in proportion to the waiters that wanted it, and the
// nearest deadline is found in O(log n): a 1,024-rank join, where every rank
// waits while the others arrive, no longer rescans every waiter per SET.
//
// Exactness: a key can be deleted after it was counted as present, so the
// table only proposes candidates (key_set); the server checks their keys
// against the map and parks again whatever is still missing.

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace dtrain::store_detail {

class WaiterTable {
 public:
  using Clock = std::chrono::steady_clock;
  struct Waiter {
    enum Kind : uint8_t { kGet, kWait, kC10dWait };
    uint64_t conn = 0;
    uint32_t request_id = 0;
    Kind kind = kWait;                // GET replies with the value, WAIT with OK
    std::vector<std::string> keys;    // as requested (GET: one)
    Clock::time_point deadline = Clock::time_point::max();
  };

  // Parks `w` until every key of `missing` (the subset of w.keys not stored
  // now; not empty) has been set, or its deadline passes.
  void park(Waiter w, const std::vector<std::string>& missing);

  // `key` was stored: the waiters that now have every key they were
  // missing, taken off the table in the order they were parked.
  std::vector<Waiter> key_set(const std::string& key);

  // The waiters whose deadline is at or before `now`, taken off the table.
  std::vector<Waiter> expire(Clock::time_point now);

  // Takes away every waiter of `conn` (its connection closed), or only its
  // c10d WAITs (CANCEL_WAIT).
  void drop_connection(uint64_t conn);
  void drop_c10d_waits(uint64_t conn);

  // The nearest deadline, or Clock::time_point::max() when none.
  Clock::time_point next_deadline() const;
  size_t size() const { return entries_.size(); }
  size_t count_for(uint64_t conn) const;

 private:
  struct Entry {
    Waiter waiter;
    std::vector<std::string> missing;  // the keys it parked for (each indexed once)
    size_t left = 0;                   // how many of them have not been set since
    std::multimap<Clock::time_point, uint64_t>::iterator by_deadline;
  };

  Waiter take(uint64_t id);
  template <typename Pred>
  void drop_if(uint64_t conn, Pred pred);

  uint64_t next_id_ = 1;  // ids grow, so they order waiters by arrival
  std::map<uint64_t, Entry> entries_;
  std::unordered_map<std::string, std::unordered_set<uint64_t>> by_key_;
  std::multimap<Clock::time_point, uint64_t> by_deadline_;
  std::unordered_map<uint64_t, std::unordered_set<uint64_t>> by_conn_;
};

}  // namespace dtrain::store_detail
