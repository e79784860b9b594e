#include "address.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

namespace dtrain::run {
namespace {

// getaddrinfo for a numeric or named host; the caller frees.
addrinfo* resolve(const std::string& host, const char* port, int socktype) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = socktype;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), port, &hints, &res);
  if (rc != 0 || !res)
    throw std::runtime_error("cannot resolve '" + host + "': " + gai_strerror(rc));
  return res;
}

std::string numeric(const sockaddr* sa, socklen_t len) {
  char buf[NI_MAXHOST] = {};
  getnameinfo(sa, len, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST);
  return buf;
}

}  // namespace

std::string address_towards(const std::string& host) {
  addrinfo* res = resolve(host, "9", SOCK_DGRAM);
  int fd = socket(res->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  std::string out;
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0)
      out = numeric(reinterpret_cast<sockaddr*>(&local), len);
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  if (out.empty()) throw std::runtime_error("no route to '" + host + "'");
  return out;
}

}  // namespace dtrain::run
