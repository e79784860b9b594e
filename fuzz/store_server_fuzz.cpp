// libFuzzer harness: the TCP store server's request handling, both wire
// dialects (dtrain's frames and PyTorch's c10d), as one hostile client sees
// it, with and without a job token. Each input is the whole byte stream of
// one connection: the harness
// connects to a server living in this process, sends the bytes, closes its
// sending side and reads every reply until the server closes. The server
// runs with small caps, so its state stays bounded across millions of
// inputs; a crash, a sanitizer report, or a connection the server never
// closes (a hang: 5 s) fails the run.

#include <poll.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "common/socket.h"
#include "store/tcp_store_server.h"

namespace {

using namespace std::chrono_literals;
using dtrain::TcpStoreServer;

// Two servers: one without a job token, one with (its AUTH_HELLO /
// AUTH_PROOF exchange, and its refusal of any other frame, or of one
// longer than the handshake's, from the header before the proof). Inputs
// of odd length go to the one with a token (a mutation that adds or drops
// a byte moves an input over). The c10d scan fed in pieces has its own
// harness (c10d_scan_fuzz).
TcpStoreServer& server(bool with_token) {
  static TcpStoreServer* s[2] = {nullptr, nullptr};
  if (!s[with_token]) {
    TcpStoreServer::Limits limits;
    limits.max_bytes = 64 << 20;
    limits.max_keys = 4096;
    s[with_token] = new TcpStoreServer("127.0.0.1", 0, limits,
                                       with_token ? std::optional<std::string>("fuzz-token")
                                                  : std::nullopt);
  }
  return *s[with_token];
}

[[noreturn]] void hang(const char* what) {
  std::fprintf(stderr, "store_server_fuzz: %s within 5 s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto deadline = dtrain::net::Clock::now() + 5s;
  const bool with_token = size % 2 == 1;
  dtrain::net::Fd fd = dtrain::net::connect_to("127.0.0.1", server(with_token).port(), deadline);
  // The server may stop reading (a parked GET, replies not read): then the
  // rest of the input is simply not delivered, as for a real client.
  size_t sent = 0;
  while (sent < size) {
    pollfd p{fd.get(), POLLOUT | POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) break;
    if (p.revents & POLLIN) {
      char sink[65536];
      if (::recv(fd.get(), sink, sizeof(sink), MSG_DONTWAIT) == 0) break;  // closed on us
    }
    if (!(p.revents & POLLOUT)) continue;
    const ssize_t n = ::send(fd.get(), data + sent, size - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  ::shutdown(fd.get(), SHUT_WR);
  char buf[65536];
  for (;;) {  // every reply, until the server closes
    pollfd p{fd.get(), POLLIN, 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - dtrain::net::Clock::now());
    if (left.count() <= 0) hang("the server did not close the connection");
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    const ssize_t n = ::recv(fd.get(), buf, sizeof(buf), 0);
    if (n <= 0) break;
  }
  // Close with a reset: no TIME_WAIT, so millions of runs do not use up
  // the loopback's ephemeral ports.
  const linger now{1, 0};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_LINGER, &now, sizeof(now));
  return 0;
}
