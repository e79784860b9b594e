#pragma once

// Small POSIX socket helpers shared by the TCP store and the init code.
// Every blocking helper takes a deadline; failures throw dtrain::NetworkError
// or dtrain::TimeoutError naming host:port.

#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace dtrain::net {

using Clock = std::chrono::steady_clock;

// Owns a file descriptor; closes it on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd();
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { int f = fd_; fd_ = -1; return f; }
  explicit operator bool() const { return fd_ >= 0; }
  void reset();

 private:
  int fd_ = -1;
};

// "host:port", with brackets around IPv6 literals.
std::string endpoint(const std::string& host, uint16_t port);

// Throws InvalidArgument naming `what` when host does not resolve.
void check_resolves(const std::string& host, const std::string& what);

// Parses a port; throws InvalidArgument naming `what` and the text.
uint16_t parse_port(const std::string& text, const std::string& what);

// Listening socket bound to host:port (port 0 = any free port). Fails at
// once with NetworkError "... host:port: Address already in use".
Fd listen_on(const std::string& host, uint16_t port, uint16_t* bound_port);

// Connects, retrying refused connections until the deadline (the server may
// not be up yet). TimeoutError names host:port and the last error.
Fd connect_to(const std::string& host, uint16_t port, Clock::time_point deadline);

// Sends/receives exactly n bytes before the deadline.
void send_all(int fd, const void* data, size_t n, Clock::time_point deadline,
              const std::string& peer);
void recv_all(int fd, void* data, size_t n, Clock::time_point deadline,
              const std::string& peer);

// The local address this machine would use to reach `host` (no packet is
// sent: a UDP socket is connected and read back). Used to tell peers where to
// find our listening sockets when ranks span machines.
std::string local_address_towards(const std::string& host);
// The same, giving up at `deadline` (TimeoutError) and calling `check`
// every 50 ms while `host` is looked up: whatever `check` throws (a
// launcher's "a signal arrived") abandons the lookup and propagates.
std::string local_address_towards(const std::string& host, Clock::time_point deadline,
                                  const std::function<void()>& check);

// The first IPv4/IPv6 address of a network interface (DTRAIN_SOCKET_IFNAME).
std::string interface_address(const std::string& ifname);

bool is_loopback(const std::string& host);

// Raises the soft RLIMIT_NOFILE to the hard limit (where it is lower): a
// store serving N ranks holds N connections, a tcp group's rank (N-1) x
// streams. Called when a store server or a tcp group starts.
void raise_open_file_limit();

}  // namespace dtrain::net
