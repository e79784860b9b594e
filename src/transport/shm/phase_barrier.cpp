#include "transport/shm/phase_barrier.h"

#include <algorithm>
#include <cerrno>

#include "common/enforce.h"
#include "transport/shm/futex.h"
#include "transport/shm/segment.h"

namespace dtrain::shm {
namespace {

constexpr std::chrono::nanoseconds kMinSpin = std::chrono::microseconds(20);
constexpr std::chrono::nanoseconds kMaxSpin = std::chrono::microseconds(320);
constexpr auto kLivenessCheck = std::chrono::milliseconds(100);

bool reached(const std::atomic<uint32_t>& phase, uint32_t target) {
  // Wrap-around safe: counters only move forward, by less than 2^31.
  return static_cast<int32_t>(phase.load(std::memory_order_acquire) - target) >= 0;
}

}  // namespace

PhaseBarrier::PhaseBarrier(PhaseCounter* counters, int rank, int size, const Segment& segment)
    : counters_(counters),
      rank_(rank),
      size_(size),
      segment_(segment),
      phase_(counters[rank].phase.load(std::memory_order_relaxed)),
      spin_(kMinSpin) {}

void PhaseBarrier::arrive_and_wait(Clock::time_point deadline, const std::string& what) {
  auto& mine = counters_[rank_];
  ++phase_;
  mine.phase.store(phase_, std::memory_order_seq_cst);
  // Pairs with the sleeper's increment-then-recheck: either it sees the new
  // phase before sleeping or we see it counted here and wake it.
  if (mine.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(mine.phase);
  for (int peer = 0; peer < size_; ++peer)
    if (peer != rank_) wait_for(peer, phase_, deadline, what);
}

void PhaseBarrier::wait_for(int peer, uint32_t target, Clock::time_point deadline,
                            const std::string& what) {
  auto& theirs = counters_[peer];
  if (reached(theirs.phase, target)) return;  // here first: no clock read
  const auto start = Clock::now();
  const auto spin_until = start + spin_;
  for (int i = 0; !reached(theirs.phase, target); ++i) {
    DTRAIN_CPU_RELAX();
    if ((i & 63) == 63 && Clock::now() >= spin_until) break;
  }
  if (reached(theirs.phase, target)) return;
  sleep_until_reached(peer, target, deadline, what);
  // Slept, but the peer came soon after: spin longer next time, so that two
  // ranks do not settle into waking each other by futex at every step. A
  // peer that was busy for long: spin less, the CPU is better left to it.
  const auto waited = Clock::now() - start;
  if (waited < 2 * kMaxSpin)
    spin_ = std::min(spin_ * 2, kMaxSpin);
  else
    spin_ = std::max(spin_ / 2, kMinSpin);
}

void PhaseBarrier::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    if (aborted_.load()) return;
    abort_why_ = why;
  }
  aborted_.store(true);
  for (int peer = 0; peer < size_; ++peer) futex_wake_all(counters_[peer].phase);  // this rank's sleep, if any
}

void PhaseBarrier::sleep_until_reached(int peer, uint32_t target, Clock::time_point deadline,
                                       const std::string& what) {
  auto& theirs = counters_[peer];
  while (!reached(theirs.phase, target)) {
    if (aborted_.load()) {
      std::lock_guard<std::mutex> lock(abort_mutex_);
      throw NetworkError(detail::cat(what, " failed: ", abort_why_));
    }
    const auto now = Clock::now();
    if (now >= deadline)
      throw TimeoutError(detail::cat(
          what, " timed out waiting for rank ", peer,
          " (it is alive but has not reached this collective: stopped, stuck, or running "
          "different collectives)"));
    const auto slice = std::min<Clock::duration>(deadline - now, kLivenessCheck);
    theirs.sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = theirs.phase.load(std::memory_order_seq_cst);
    if (static_cast<int32_t>(seen - target) < 0) futex_wait(theirs.phase, seen, slice);
    theirs.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (!reached(theirs.phase, target) && !segment_.slot_locked_by_other(peer))
      throw NetworkError(detail::cat(what, " failed: rank ", peer,
                                     " exited, was killed, or destroyed the group"));
  }
}

}  // namespace dtrain::shm
