#pragma once

// The only synchronization the shm slots use (slots.h): a barrier over per-rank
// phase counters that live in the shared segment (no torch here).
//
// arrive_and_wait(): a rank bumps its own counter and waits until every
// peer's counter has reached the same phase. Waiting spins for a few
// microseconds (peers inside the same collective arrive that fast), then
// sleeps on the peer's counter with futex(2), so a rank whose peers are
// still computing costs no CPU. The spin adapts (20 us to 320 us): a wait
// that slept and yet ended soon after the spin gave up doubles it, a wait
// for a peer that was busy for long halves it. With a fixed 20 us, one late
// peer could lock two ranks into waking each other up by futex at every
// step of a collective: a 16 MiB all_reduce then ran at a quarter of its
// speed in some runs (1 in 25 measured), in any build type. A sleeping
// waiter wakes every 100 ms to ask the kernel whether the peer still holds
// its liveness lock (segment.h): a killed peer becomes a NetworkError within
// ~0.1 s, a stopped or stuck one a TimeoutError at the deadline.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace dtrain::shm {

class Segment;

// One per rank, one cache line each so ranks never write a shared line.
struct alignas(64) PhaseCounter {
  std::atomic<uint32_t> phase;    // written by its rank only
  std::atomic<uint32_t> sleepers;  // peers in futex_wait on `phase`
};
static_assert(std::atomic<uint32_t>::is_always_lock_free);

class PhaseBarrier {
 public:
  using Clock = std::chrono::steady_clock;

  PhaseBarrier(PhaseCounter* counters, int rank, int size, const Segment& segment);

  // `what` names the operation in errors ("all_reduce #3 on group ...").
  void arrive_and_wait(Clock::time_point deadline, const std::string& what);
  // From any thread: a wait in progress, and every later one, fails with
  // NetworkError "<what> failed: <why>" (within a liveness check).
  void abort(const std::string& why);

 private:
  void wait_for(int peer, uint32_t target, Clock::time_point deadline, const std::string& what);
  void sleep_until_reached(int peer, uint32_t target, Clock::time_point deadline,
                           const std::string& what);

  PhaseCounter* counters_;
  int rank_;
  int size_;
  const Segment& segment_;
  uint32_t phase_;
  std::chrono::nanoseconds spin_;  // how long to spin before sleeping (adapts)
  std::atomic<bool> aborted_{false};
  std::mutex abort_mutex_;
  std::string abort_why_;  // set once, before aborted_
};

}  // namespace dtrain::shm
