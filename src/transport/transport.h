#pragma once

// The transport seam: how bytes move between the ranks of one group.
// Collective algorithms (src/algorithms/) are written once against this
// interface; a transport (TCP sockets today; RDMA, UCX or NCCL's net later)
// only moves tagged byte ranges. It knows nothing of tensors, dtypes or
// collectives, and includes no torch header.
//
// Contract:
//  - isend/irecv post an operation and return at once; they never block on
//    the peer. The buffer must stay valid and (for a receive) untouched until
//    the request's wait() has returned or thrown.
//  - Sends and receives are matched per (peer, tag) in posting order; a
//    receive must name the same byte count as the matching send (otherwise
//    both groups fail with CollectiveMismatch naming the peer and sizes).
//    Messages of different tags never block each other.
//  - wait(deadline) returns when the operation is done. If it fails, or the
//    deadline passes, the whole transport is broken first (every pending
//    request is aborted and its buffer released, so an algorithm may unwind
//    and free its scratch memory), then the error is thrown: TimeoutError,
//    NetworkError naming the peer (it closed the connection, sent garbage),
//    or CollectiveMismatch. Every later post fails with that first error.
//  - irecv_any receives the first message with its tag from whichever peer
//    it is matched with first (messages already held, or the next to
//    arrive); receives posted for a specific peer are matched before it.
//    The request's source() names the peer once wait() has returned. Do not
//    mix it with specific receives of the same tag from the same peer that
//    are posted at the same time: which of them gets which message is then
//    not defined.
//  - Memory for messages that arrive before their receive is posted is
//    bounded: a sender's payloads run ahead only within what the receiver
//    granted (DTRAIN_TCP_UNEXPECTED_BYTES per group); beyond it a message
//    is announced at once and its send stays pending until the receiver
//    posts its receive, and a receiver holds a bounded count of such
//    announcements (DTRAIN_TCP_UNEXPECTED_MESSAGES). So a send of a large
//    message may complete only once its receive is posted: post receives
//    before waiting on sends that they answer. No message waits behind an
//    earlier unmatched one.
//  - A transport's own threads never call back into the caller, except
//    for Request::on_done hooks, which must only signal (no transport
//    call, no blocking).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>

namespace dtrain::transport {

using Clock = std::chrono::steady_clock;

class Request {
 public:
  virtual ~Request() = default;
  // `what` names the operation in a timeout message ("all_reduce #3 ...").
  virtual void wait(Clock::time_point deadline, const std::string& what) = 0;
  // The peer of the operation; for irecv_any, -1 until it is matched.
  virtual int source() const = 0;
  // Whether it has finished (or failed), without waiting or failing anything.
  virtual bool done() const = 0;
  // Runs `fn` once done() is true: at once (on this thread) if it is
  // already, else on the transport's thread that finishes it. Set at most
  // once per request.
  virtual void on_done(std::function<void()> fn) = 0;
};
using RequestPtr = std::shared_ptr<Request>;

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) = 0;
  virtual RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes) = 0;
  virtual RequestPtr irecv_any(uint64_t tag, void* data, size_t bytes) = 0;
  // Breaks the transport with `error` (the first one wins); pending requests
  // fail with it, their buffers released before this returns.
  virtual void fail(std::exception_ptr error) = 0;
  // Ends the transport for good. With nothing pending, each link closes in
  // order, so that what was sent arrives even though a send completes once
  // the kernel (or the ring) holds its bytes; with operations pending, they
  // fail with `error` at once and the peers hear of it. Later posts fail
  // with the first error. Destroying a transport closes it too.
  virtual void close(std::exception_ptr error) = 0;
  // The first error, or null while the transport works.
  virtual std::exception_ptr error() const = 0;
};

// Tags: collectives use the sequence number with the top bit set, point to
// point the user's tag, so the two never match each other.
constexpr uint64_t collective_tag(uint64_t seq) { return (uint64_t{1} << 63) | seq; }
constexpr uint64_t p2p_tag(int tag) { return static_cast<uint32_t>(tag); }

}  // namespace dtrain::transport
