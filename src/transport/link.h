#pragma once

// The carrier under the transport engine's frames (engine/connection.h): one
// byte stream between two ranks, and the poller that tells an I/O thread
// which of its streams can move bytes. Two kinds: TCP sockets
// (tcp/socket_link.h) and rings in shared memory (shm/ring_link.h). Both
// read and write without blocking and report like sockets do: errno says
// why nothing moved. No torch here.

#include <sys/types.h>
#include <sys/uio.h>

#include <cstdint>
#include <vector>

namespace dtrain::transport {

class Link {
 public:
  virtual ~Link() = default;
  // Like recv(2) with MSG_DONTWAIT: the bytes read; 0 once the peer ended
  // its output and all of it was read; -1 with errno (EAGAIN: nothing yet,
  // ECONNRESET: the peer is gone).
  virtual ssize_t read(void* dst, size_t n) = 0;
  // Like sendmsg(2) with MSG_DONTWAIT: the bytes taken; -1 with errno
  // (EAGAIN: no room now, EPIPE or ECONNRESET: the peer is gone).
  virtual ssize_t write(const iovec* iov, int count) = 0;
  // Ends this side's output after what was written (a FIN): the peer reads
  // all of it, then 0.
  virtual void end_output() = 0;
  // Ends both directions now: the peer's reads end, its writes fail.
  virtual void abort() = 0;
  // Whether everything written has reached the peer's side, so that it
  // survives this side's close whatever comes in afterwards. A socket's
  // bytes must be acknowledged by the peer's kernel first; a ring's are in
  // memory the peer maps.
  virtual bool delivered() const = 0;
};

// One I/O thread's view of its links. Links are registered with a key,
// which comes back with their events.
class Poller {
 public:
  enum Events : uint32_t { kIn = 1, kOut = 2 };
  struct Ready {
    void* key;
    uint32_t events;
  };
  virtual ~Poller() = default;
  // Watches `link` for input (while `in` is set: a thread that reads the
  // link itself may mute it), and for room to write while `out` is set.
  virtual void add(Link& link, void* key) = 0;
  virtual void watch(Link& link, void* key, bool in, bool out) = 0;
  virtual void remove(Link& link) = 0;
  // Blocks until some link is ready (fills `ready`; true) or until stop()
  // was called (false, now and at every later call).
  virtual bool wait(std::vector<Ready>& ready) = 0;
  // From any thread.
  virtual void stop() = 0;
};

}  // namespace dtrain::transport
