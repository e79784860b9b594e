// The shm transport's byte rings (transport/shm/ring_link.h) on their own,
// torch-free, so that ThreadSanitizer sees them: one thread writes, another
// reads, through rings far smaller than what crosses them, with the poller
// telling each when to move; the end of a stream, an abort, and a peer
// whose liveness lock is gone.

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include "transport/shm/ring_link.h"
#include "transport/shm/segment.h"

namespace dtrain::shm {
namespace {

constexpr size_t kRing = 16 << 10;

// Two ranks' view of one pair of rings and their doorbells, in a real
// segment mapped twice, as two processes would (each poller asks its own
// mapping whether the other rank still holds its liveness lock).
struct Pair {
  std::shared_ptr<Segment> seg0, seg1;  // rank 0's and rank 1's mapping
  Doorbell* bells;                      // in rank 0's mapping; the same memory
  std::unique_ptr<RingLink> a, b;       // rank 0's link to 1, rank 1's link to 0
  explicit Pair(bool rank1_alive = true) {
    const size_t ring = sizeof(RingControl) + kRing;
    seg0 = std::make_shared<Segment>(Segment::create(4096 + 2 * ring));
    seg1 = std::make_shared<Segment>(Segment::open(seg0->name(), seg0->size()));
    seg0->lock_slot(0);
    if (rank1_alive) seg1->lock_slot(1);
    seg0->unlink();
    auto* base = static_cast<uint8_t*>(seg0->data());
    bells = reinterpret_cast<Doorbell*>(base);
    auto* r01 = reinterpret_cast<RingControl*>(base + 4096);
    auto* r10 = reinterpret_cast<RingControl*>(base + 4096 + ring);
    a = std::make_unique<RingLink>(r01, r10, kRing, &bells[1], 1);
    b = std::make_unique<RingLink>(r10, r01, kRing, &bells[0], 0);
  }
};

uint8_t pattern(size_t i) { return static_cast<uint8_t>(i * 131 + (i >> 11)); }

TEST(RingLink, BytesCrossARingFarSmallerThanThemExactAndInOrder) {
  Pair pair;
  const size_t total = 8 << 20;
  std::thread writer([&] {
    RingPoller poller(&pair.bells[0], pair.seg0);
    poller.add(*pair.a, pair.a.get());
    std::vector<uint8_t> chunk(7001);
    std::vector<transport::Poller::Ready> ready;
    for (size_t sent = 0; sent < total;) {
      const size_t n = std::min(chunk.size(), total - sent);
      for (size_t i = 0; i < n; ++i) chunk[i] = pattern(sent + i);
      // Two pieces in one write, as the engine's header + payload.
      const iovec iov[2] = {{chunk.data(), n / 3}, {chunk.data() + n / 3, n - n / 3}};
      const ssize_t k = pair.a->write(iov, 2);
      if (k > 0) {
        sent += static_cast<size_t>(k);
        continue;
      }
      ASSERT_EQ(errno, EAGAIN);
      poller.watch(*pair.a, pair.a.get(), true, true);
      ASSERT_TRUE(poller.wait(ready));
      poller.watch(*pair.a, pair.a.get(), true, false);
    }
    pair.a->end_output();
  });
  RingPoller poller(&pair.bells[1], pair.seg1);
  poller.add(*pair.b, pair.b.get());
  std::vector<uint8_t> buf(4093);
  std::vector<transport::Poller::Ready> ready;
  size_t got = 0, wrong = 0;
  for (;;) {
    const ssize_t k = pair.b->read(buf.data(), buf.size());
    if (k == 0) break;
    if (k < 0) {
      ASSERT_EQ(errno, EAGAIN);
      ASSERT_TRUE(poller.wait(ready));
      continue;
    }
    for (ssize_t i = 0; i < k; ++i) wrong += buf[i] != pattern(got + i);
    got += static_cast<size_t>(k);
  }
  writer.join();
  EXPECT_EQ(got, total);
  EXPECT_EQ(wrong, 0u);
}

TEST(RingLink, AFullRingSaysEagainAndAnAbortedPeerEpipe) {
  Pair pair;
  std::vector<uint8_t> big(kRing + 100, 1);
  const iovec iov{big.data(), big.size()};
  EXPECT_EQ(pair.a->write(&iov, 1), static_cast<ssize_t>(kRing));
  EXPECT_FALSE(pair.a->writable());
  EXPECT_EQ(pair.a->write(&iov, 1), -1);
  EXPECT_EQ(errno, EAGAIN);
  pair.b->abort();  // the reader leaves: writes to it fail
  EXPECT_EQ(pair.a->write(&iov, 1), -1);
  EXPECT_EQ(errno, EPIPE);
  // And rank 0 reads the end of rank 1's output at once.
  uint8_t byte;
  EXPECT_EQ(pair.a->read(&byte, 1), 0);
}

TEST(RingLink, APeerWhoseLivenessLockIsGoneReadsAsAReset) {
  Pair pair(/*rank1_alive=*/false);  // nobody holds slot 1's lock
  const uint8_t last[3] = {7, 8, 9};
  const iovec iov{const_cast<uint8_t*>(last), sizeof(last)};
  ASSERT_EQ(pair.b->write(&iov, 1), 3);  // what it wrote before dying
  RingPoller poller(&pair.bells[0], pair.seg0);
  poller.add(*pair.a, pair.a.get());
  std::vector<transport::Poller::Ready> ready;
  uint8_t buf[8];
  EXPECT_EQ(pair.a->read(buf, sizeof(buf)), 3);  // what it wrote still arrives
  EXPECT_EQ(pair.a->read(buf, sizeof(buf)), -1);
  EXPECT_EQ(errno, EAGAIN);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(poller.wait(ready));  // the liveness check marks it (within ~0.1 s)
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_EQ(pair.a->read(buf, sizeof(buf)), -1);
  EXPECT_EQ(errno, ECONNRESET);
  EXPECT_EQ(pair.a->write(&iov, 1), -1);
  EXPECT_EQ(errno, EPIPE);
}

// The liveness check is due by the clock: an I/O thread that finds a link
// ready at every wait (here unread bytes of the dead peer, in the engine any
// busy peer) still hears of the death within about 0.1 s.
TEST(RingLink, APeerDiesUnnoticedByNoPollerThatIsNeverIdle) {
  Pair pair(/*rank1_alive=*/false);
  const uint8_t last[3] = {7, 8, 9};
  const iovec iov{const_cast<uint8_t*>(last), sizeof(last)};
  ASSERT_EQ(pair.b->write(&iov, 1), 3);  // left unread: the link stays ready
  RingPoller poller(&pair.bells[0], pair.seg0);
  poller.add(*pair.a, pair.a.get());
  std::vector<transport::Poller::Ready> ready;
  const auto start = std::chrono::steady_clock::now();
  bool gone = false;
  while (!gone && std::chrono::steady_clock::now() - start < std::chrono::seconds(2)) {
    ASSERT_TRUE(poller.wait(ready));
    ASSERT_EQ(ready.size(), 1u);
    gone = pair.a->write(&iov, 1) == -1 && errno == EPIPE;
  }
  EXPECT_TRUE(gone) << "2 s of waits that each returned at once never checked the peer";
}

TEST(RingLink, StopEndsAWaitFromAnotherThread) {
  Pair pair;
  RingPoller poller(&pair.bells[0], pair.seg0);
  std::vector<transport::Poller::Ready> ready;
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    poller.stop();
  });
  EXPECT_FALSE(poller.wait(ready));
  stopper.join();
}

}  // namespace
}  // namespace dtrain::shm
