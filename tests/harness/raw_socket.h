#pragma once

// Talking to a store server byte by byte, as a hostile or foreign client
// would (tests of the TCP store's wire handling).

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <vector>

#include "common/socket.h"

namespace dtrain::testing {

inline net::Fd raw_connect(uint16_t port) {
  return net::connect_to("127.0.0.1", port, net::Clock::now() + std::chrono::seconds(2));
}

// True when the server closes the connection within 2 s (EOF, or a reset
// because it closed with our bytes unread).
inline bool closed_by_server(int fd) {
  const auto deadline = net::Clock::now() + std::chrono::seconds(2);
  char buf[256];
  while (net::Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
    if (n > 0) return false;  // the server answered garbage instead of dropping it
  }
  return false;
}

// Whatever arrives within `wait` (nothing: empty).
inline std::vector<uint8_t> read_available(int fd, std::chrono::milliseconds wait) {
  std::vector<uint8_t> out;
  const auto deadline = net::Clock::now() + wait;
  uint8_t buf[4096];
  while (net::Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 20) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  return out;
}

}  // namespace dtrain::testing
