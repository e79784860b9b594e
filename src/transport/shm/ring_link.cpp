#include "transport/shm/ring_link.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "transport/shm/futex.h"
#include "transport/shm/segment.h"

namespace dtrain::shm {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kSpin = std::chrono::microseconds(20);
constexpr auto kLivenessCheck = std::chrono::milliseconds(100);

void ring(Doorbell& bell) {
  bell.rings.fetch_add(1, std::memory_order_seq_cst);
  // Pairs with the poller's store to `sleeping` before its last look.
  if (bell.sleeping.load(std::memory_order_seq_cst) != 0) futex_wake_all(bell.rings);
}

}  // namespace

RingLink::RingLink(RingControl* out, RingControl* in, size_t ring_bytes, Doorbell* peer_bell,
                   int peer)
    : out_(out), in_(in), ring_bytes_(ring_bytes), peer_bell_(peer_bell), peer_(peer) {}

void RingLink::ring_peer() { ring(*peer_bell_); }

ssize_t RingLink::read(void* dst, size_t n) {
  const uint64_t tail = in_->reader.pos.load(std::memory_order_relaxed);
  uint64_t head = in_->writer.pos.load(std::memory_order_acquire);
  if (head == tail) {
    // The writer ends its output after its last byte: look once more.
    if (in_->writer.closed.load(std::memory_order_acquire) != 0) {
      head = in_->writer.pos.load(std::memory_order_acquire);
      if (head == tail) return 0;
    } else {
      errno = gone_.load(std::memory_order_acquire) ? ECONNRESET : EAGAIN;
      return -1;
    }
  }
  const size_t k = std::min<uint64_t>(n, head - tail);
  const size_t at = tail % ring_bytes_;
  const size_t first = std::min(k, ring_bytes_ - at);
  std::memcpy(dst, data(in_) + at, first);
  if (k > first) std::memcpy(static_cast<uint8_t*>(dst) + first, data(in_), k - first);
  in_->reader.pos.store(tail + k, std::memory_order_release);
  ring_peer();  // it may wait for room
  return static_cast<ssize_t>(k);
}

ssize_t RingLink::write(const iovec* iov, int count) {
  if (out_->reader.closed.load(std::memory_order_acquire) != 0 ||
      gone_.load(std::memory_order_acquire)) {
    errno = EPIPE;
    return -1;
  }
  const uint64_t head = out_->writer.pos.load(std::memory_order_relaxed);
  const uint64_t tail = out_->reader.pos.load(std::memory_order_acquire);
  size_t room = ring_bytes_ - static_cast<size_t>(head - tail);
  if (room == 0) {
    errno = EAGAIN;
    return -1;
  }
  uint64_t at = head;
  for (int i = 0; i < count && room > 0; ++i) {
    const auto* src = static_cast<const uint8_t*>(iov[i].iov_base);
    size_t left = std::min(iov[i].iov_len, room);
    room -= left;
    while (left > 0) {
      const size_t off = at % ring_bytes_;
      const size_t k = std::min(left, ring_bytes_ - off);
      std::memcpy(data(out_) + off, src, k);
      src += k;
      at += k;
      left -= k;
    }
  }
  out_->writer.pos.store(at, std::memory_order_release);
  ring_peer();
  return static_cast<ssize_t>(at - head);
}

void RingLink::end_output() {
  out_->writer.closed.store(1, std::memory_order_release);
  ring_peer();
}

void RingLink::abort() {
  out_->writer.closed.store(1, std::memory_order_release);
  in_->reader.closed.store(1, std::memory_order_release);
  ring_peer();
}

bool RingLink::readable() const {
  return in_->writer.pos.load(std::memory_order_acquire) !=
             in_->reader.pos.load(std::memory_order_relaxed) ||
         in_->writer.closed.load(std::memory_order_acquire) != 0 ||
         gone_.load(std::memory_order_acquire);
}

bool RingLink::writable() const {
  return out_->writer.pos.load(std::memory_order_relaxed) -
                 out_->reader.pos.load(std::memory_order_acquire) <
             ring_bytes_ ||
         out_->reader.closed.load(std::memory_order_acquire) != 0 ||
         gone_.load(std::memory_order_acquire);
}

RingPoller::RingPoller(Doorbell* own_bell, std::shared_ptr<const Segment> segment)
    : own_bell_(own_bell), segment_(std::move(segment)), next_check_(Clock::now() + kLivenessCheck) {}

void RingPoller::add(Link& link, void* key) {
  std::lock_guard<std::mutex> lock(mutex_);
  entries_.push_back({&dynamic_cast<RingLink&>(link), key, true, false});
}

void RingPoller::watch(Link& link, void* key, bool in, bool out) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& e : entries_)
      if (e.link == &link) {
        e.key = key;
        e.in = in;
        e.out = out;
      }
  }
  if (in || out) ring(*own_bell_);  // the I/O thread looks again
}

void RingPoller::remove(Link& link) {
  std::lock_guard<std::mutex> lock(mutex_);
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [&](const Entry& e) { return e.link == &link; }),
                 entries_.end());
}

void RingPoller::scan(std::vector<Ready>& ready) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& e : entries_) {
    uint32_t events = e.in && e.link->readable() ? kIn : 0u;
    if (e.out && e.link->writable()) events |= kOut;
    if (events) ready.push_back({e.key, events});
  }
}

void RingPoller::check_peers() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& e : entries_)
    if (!segment_->slot_locked_by_other(e.link->peer())) e.link->set_gone();
}

bool RingPoller::wait(std::vector<Ready>& ready) {
  ready.clear();
  const auto spin_until = Clock::now() + kSpin;
  for (;;) {
    if (stopped_.load(std::memory_order_acquire)) return false;
    const uint32_t seen = own_bell_->rings.load(std::memory_order_seq_cst);
    // Due by the clock, not by idleness: a thread that finds some link
    // ready at every call still hears of a peer that died meanwhile.
    const auto now = Clock::now();
    if (now >= next_check_) {
      check_peers();
      next_check_ = now + kLivenessCheck;
    }
    scan(ready);
    if (!ready.empty()) return true;
    if (now < spin_until) {
      DTRAIN_CPU_RELAX();
      continue;
    }
    own_bell_->sleeping.store(1, std::memory_order_seq_cst);
    if (own_bell_->rings.load(std::memory_order_seq_cst) == seen &&
        !stopped_.load(std::memory_order_acquire))
      futex_wait(own_bell_->rings, seen, next_check_ - now);
    own_bell_->sleeping.store(0, std::memory_order_relaxed);
  }
}

void RingPoller::stop() {
  stopped_.store(true, std::memory_order_release);
  ring(*own_bell_);
}

}  // namespace dtrain::shm
