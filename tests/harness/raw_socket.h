#pragma once

// Talking to a store server byte by byte, as a hostile or foreign client
// would (tests of the TCP store's wire handling).

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "common/socket.h"
#include "store/wire.h"

namespace dtrain::testing {

inline net::Fd raw_connect(uint16_t port) {
  return net::connect_to("127.0.0.1", port, net::Clock::now() + std::chrono::seconds(2));
}

// True when the server closes the connection within 2 s (EOF, or a reset
// because it closed with our bytes unread), having sent nothing but, at
// most, one REFUSED frame saying why (its reason goes to *why).
inline bool closed_by_server(int fd, std::string* why = nullptr) {
  const auto deadline = net::Clock::now() + std::chrono::seconds(2);
  std::vector<uint8_t> got;
  char buf[256];
  auto only_a_refusal = [&] {
    if (got.empty()) return true;
    if (got.size() < wire::kHeaderBytes + 4) return false;
    const auto h = wire::decode_header(got.data());
    if (h.magic != wire::kMagic || h.opcode != wire::kRefused ||
        got.size() != wire::kHeaderBytes + h.length)
      return false;
    if (why) why->assign(got.begin() + wire::kHeaderBytes + 4, got.end());
    return true;
  };
  while (net::Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return only_a_refusal();
    if (n > 0) got.insert(got.end(), buf, buf + n);
    if (got.size() > 4096) return false;  // the server answered garbage instead of dropping it
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
