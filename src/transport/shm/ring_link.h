#pragma once

// The shm transport's carrier: for each ordered pair of ranks on one machine
// a single-producer, single-consumer byte ring in the group's segment, read
// and written like a socket (transport/link.h), and a Poller that serves one
// rank's rings from one I/O thread. No torch here.
//
// A ring's writer advances `written` after copying bytes in, its reader
// `read` after copying them out; each owns its cache line. After every
// move, the side that moved rings the other rank's doorbell (a counter it
// sleeps on with futex(2)), so one doorbell per rank serves all its rings:
// data to read, and room to write. The poller spins a little before it
// sleeps (peers answer within microseconds), and every 100 ms, asleep or
// busy, it asks the kernel whether each peer still holds its liveness lock
// (segment.h): a dead peer's link then reads what is left and then fails
// with ECONNRESET, and writes to it fail with EPIPE, as a socket would.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "transport/link.h"

namespace dtrain::shm {

class Segment;
using transport::Link;

struct alignas(64) Doorbell {
  std::atomic<uint32_t> rings;     // bumped by whoever moved a ring of this rank
  std::atomic<uint32_t> sleeping;  // the rank's poller is (about to be) in futex_wait
};

// One direction between two ranks; `data` follows it in the segment.
struct RingControl {
  struct alignas(64) End {
    std::atomic<uint64_t> pos;     // bytes written (writer) or read (reader) so far
    std::atomic<uint32_t> closed;  // writer: output ended; reader: aborted
  };
  End writer, reader;
};
static_assert(sizeof(RingControl) == 128, "two cache lines");

class RingLink final : public transport::Link {
 public:
  // `out` carries this rank's bytes to the peer, `in` the peer's to this
  // rank; `peer_bell` is the peer's doorbell, rung after every move;
  // `peer` is the peer's slot in the segment (whose liveness lock the
  // poller checks), not its rank in the group.
  RingLink(RingControl* out, RingControl* in, size_t ring_bytes, Doorbell* peer_bell, int peer);
  ssize_t read(void* dst, size_t n) override;
  ssize_t write(const iovec* iov, int count) override;
  void end_output() override;
  void abort() override;
  bool delivered() const override { return true; }

  bool readable() const;
  bool writable() const;
  int peer() const { return peer_; }
  // The peer died (its liveness lock is gone): set by the poller.
  void set_gone() { gone_.store(true, std::memory_order_release); }

 private:
  uint8_t* data(RingControl* ring) const { return reinterpret_cast<uint8_t*>(ring + 1); }
  void ring_peer();

  RingControl* out_;
  RingControl* in_;
  size_t ring_bytes_;
  Doorbell* peer_bell_;
  int peer_;
  std::atomic<bool> gone_{false};
};

// Takes RingLinks only.
class RingPoller final : public transport::Poller {
 public:
  // Keeps the segment mapped (and this rank's liveness lock held) as long
  // as the transport lives.
  RingPoller(Doorbell* own_bell, std::shared_ptr<const Segment> segment);
  void add(Link& link, void* key) override;
  void watch(Link& link, void* key, bool in, bool out) override;
  void remove(Link& link) override;
  bool wait(std::vector<Ready>& ready) override;
  void stop() override;

 private:
  struct Entry {
    RingLink* link;
    void* key;
    bool in = true;
    bool out = false;
  };
  // The links that can move bytes now; under mutex_.
  void scan(std::vector<Ready>& ready);
  void check_peers();  // marks the links of dead peers

  Doorbell* own_bell_;
  std::shared_ptr<const Segment> segment_;
  std::mutex mutex_;
  std::vector<Entry> entries_;
  std::atomic<bool> stopped_{false};
  // When wait() next asks whether the peers live (only wait() touches it:
  // one I/O thread per poller).
  std::chrono::steady_clock::time_point next_check_{};
};

}  // namespace dtrain::shm
