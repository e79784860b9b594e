#pragma once

// One link of the transport engine (one stream to one peer: a TCP
// connection or a ring) and the frames it carries. Private to
// src/transport/.
//
// Locking: a Connection's mutex guards its queues and its socket; it is
// taken before a Request's own mutex, never the other way round. Whoever
// holds it may read into or write from the buffers of queued parts, which is
// why aborting a connection (under the mutex) is enough to release them.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/link.h"
#include "transport/transport.h"

namespace dtrain::transport::engine {

class Engine;

// Every frame starts with this header. A message's part on one stream
// travels in one of two ways (flow control, see transport.h):
//  - eager, as kData with its payload, while it fits the eager credit the
//    receiver granted in its hello; the receiver gives credit back (kCredit)
//    once the bytes reached a posted receive;
//  - by rendezvous otherwise: kRts announces it (no payload), the receiver
//    answers kCts once a receive is posted for it, and the payload follows
//    as kRndvData. Rendezvous ids are not sent with kRts: both ends count
//    the kRts frames of the connection.
// kData and kRts carry the message's tag and `total` (its whole size; the
// part on this stream follows from it, see part_range()) and are matched in
// arrival order; kCts and kRndvData carry the rendezvous id in `tag`.
// Each kData frame costs the credit kHeldEntryCharge besides its payload
// (what the receiver's entry for it costs when it arrives before its
// receive), so zero-byte messages are bounded by the credit too. A kRts
// costs no credit: an announcement always goes at once, so that no message
// ever waits behind an earlier one that its receiver has not asked for yet
// (a later collective behind unmatched sends would hang). The receiver
// bounds announcements by count instead: it holds at most
// EngineOptions::max_announced of them unmatched, over all its links, and
// closes the group naming that cap when a peer announces more.
enum FrameKind : uint32_t {
  kData = 0,
  kRts = 1,
  kCts = 2,
  kRndvData = 3,  // total: the part's bytes
  kCredit = 4,    // total: eager bytes given back
};
struct FrameHeader {
  uint32_t magic;
  uint32_t kind;
  uint64_t tag;
  uint64_t total;
};
static_assert(sizeof(FrameHeader) == 24, "the frame header is 24 bytes on the wire");
constexpr uint32_t kFrameMagic = 0x6d465464;  // "dTFm"
// More than a held entry (Held, its list node and its payload's
// allocation) costs the receiver, so that what a peer makes it hold stays
// within the credit it granted.
constexpr uint64_t kHeldEntryCharge = 256;

// The byte range of a `total`-byte message that stream `s` of `streams`
// carries; {0, 0, false} when it carries no frame of that message.
struct PartRange {
  size_t offset, bytes;
  bool present;
};
PartRange part_range(size_t total, int streams, int s);

struct Connection;
// A CollectiveMismatch's text: the peer sent `sent` bytes, `expected` were posted.
std::string mismatch_text(const Connection& c, uint64_t sent, uint64_t expected);

class EngineRequest final : public Request {
 public:
  EngineRequest(Engine& transport, int peer, int parts)
      : transport_(transport), peer_(peer), remaining_(parts) {}
  void wait(Clock::time_point deadline, const std::string& what) override;
  int source() const override { return peer_.load(); }
  bool done() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return remaining_ == 0 || error_ != nullptr;
  }
  void on_done(std::function<void()> fn) override;
  // An irecv_any matched with `peer`, before any of its `parts` is posted.
  void bind(int peer, int parts) {
    std::lock_guard<std::mutex> lock(mutex_);
    remaining_ = parts;
    peer_.store(peer);
  }
  // The link a waiter may serve itself while it waits (Engine::poll): the
  // peer's first stream, for a request of one part; set before posting.
  void poll_on(Connection* c) { poll_ = c; }
  void part_done();
  void fail(std::exception_ptr error);
  bool failed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_ != nullptr;
  }

 private:
  // Runs the on_done hook once the request finished (mutex_ not held).
  void finished(std::unique_lock<std::mutex>& lock);
  Engine& transport_;
  std::atomic<int> peer_;  // -1: an irecv_any not matched yet
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  int remaining_;
  std::exception_ptr error_;
  std::function<void()> on_done_;
  Connection* poll_ = nullptr;
};

// One stream's share of a request. Queued to send, it is a kData or
// kRndvData frame with this payload, or a kRts frame (bytes 0, no request:
// the part itself waits in Connection::awaiting_cts).
struct Part {
  uint8_t* data = nullptr;
  size_t bytes = 0;  // this part
  size_t done = 0;
  uint64_t tag = 0;
  uint64_t total = 0;  // the whole message
  FrameKind kind = kData;
  uint64_t rendezvous = 0;  // the id, for kRts and kRndvData
  std::shared_ptr<EngineRequest> request;
};

// A message that arrived before its receive was posted: an eager payload,
// held in full, or a kRts, which holds no bytes.
struct Held {
  uint64_t tag = 0;
  uint64_t total = 0;
  std::unique_ptr<uint8_t[]> data;  // this stream's part (not zeroed)
  size_t bytes = 0;
  size_t done = 0;
  bool complete = false;
  bool rendezvous = false;  // a kRts: the payload comes after our kCts
  uint64_t id = 0;          // its rendezvous id
  std::optional<Part> waiter;  // a receive posted while it was arriving
};

struct Connection {
  std::mutex mutex;
  std::unique_ptr<Link> link;
  int peer = 0;
  int stream = 0;
  Poller* poller = nullptr;  // the stream thread's
  std::string name;    // "rank 3 (10.0.0.2:41234)"
  std::string label;   // "tcp" or "shm": the first word of its messages
  std::exception_ptr dead;  // set once: EOF, error, or the transport failed
  bool polled = false;      // its link is in `poller`'s set (until it dies)

  // Sending: parts in order, and control frames (kCts, kCredit), which go
  // before the next part; the frame being written may be either.
  std::deque<Part> sendq;
  std::deque<FrameHeader> controlq;
  FrameHeader send_header{};
  size_t send_header_done = 0;
  enum class Writing { kNothing, kControl, kPart } writing = Writing::kNothing;
  bool watching_out = false;  // Poller::kOut requested
  // Waiters serving this link's input themselves (Engine::poll); while
  // there are any, the I/O thread's poller does not watch its input.
  int waiters_polling = 0;
  bool input_muted = false;
  int output_error = 0;  // errno of a failed write of control frames only (see flush)

  // Flow control, this rank as the sender: eager bytes it may still send
  // (the peer's grant, less what is out and not given back), and its parts
  // waiting for the peer's kCts, by rendezvous id.
  uint64_t credit = 0;
  uint64_t credit_limit = 0;  // the peer's grant
  uint64_t rts_sent = 0;
  std::unordered_map<uint64_t, Part> awaiting_cts;
  // ... and as the receiver: its own grant, the eager bytes received and
  // not given back yet, those of them consumed (owed back), the kRts frames
  // counted, and the receives whose rendezvous payload is due.
  uint64_t eager_limit = 0;
  uint64_t eager_in = 0;
  uint64_t owed = 0;
  uint64_t rts_seen = 0;
  size_t announced = 0;  // kRts entries in `held` (counted in Engine::announced_ too)
  std::unordered_map<uint64_t, Part> awaiting_data;

  // Receiving.
  std::unique_ptr<uint8_t[]> stage;  // kStageBytes, read ahead (engine.h)
  size_t staged_begin = 0, staged_end = 0;  // its bytes not consumed yet
  std::deque<Part> recvq;  // posted, not yet matched, in order
  std::list<Held> held;    // unmatched arrivals, in order
  FrameHeader recv_header{};
  size_t recv_header_done = 0;
  bool in_message = false;
  Part current;               // when the payload goes straight to a receive
  Held* current_held = nullptr;  // when it is held
  // Parts of an irecv_any that this connection's I/O thread matched, for
  // the peer's other streams: posted once this connection's mutex is free.
  std::vector<std::pair<Connection*, Part>> deferred;
};

// An irecv_any not matched with a peer yet.
struct AnyReceive {
  uint64_t tag = 0;
  uint8_t* data = nullptr;
  size_t bytes = 0;
  std::shared_ptr<EngineRequest> request;
};

}  // namespace dtrain::transport::engine
