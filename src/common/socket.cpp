#include "common/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>

#include "common/enforce.h"

namespace dtrain::net {
namespace {

using std::chrono::milliseconds;

// getaddrinfo() result owned by a unique_ptr.
using AddrList = std::unique_ptr<addrinfo, decltype(&freeaddrinfo)>;

// resolve()'s answer when the deadline passed first; getaddrinfo's own
// codes are 0 or negative.
constexpr int kResolveTimedOut = 1;

// The helpers that take no deadline (check_resolves, listen_on,
// local_address_towards) give a name this long: as long as glibc's default
// resolver settings take to give up on three silent DNS servers (5 s x 2
// attempts each), so no lookup that glibc would let succeed is cut short
// unless resolv.conf raises its timeouts.
constexpr std::chrono::seconds kResolveTimeout{30};
Clock::time_point resolve_deadline() { return Clock::now() + kResolveTimeout; }

// One name lookup on a thread of its own, which the caller may abandon.
struct Lookup {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
  bool abandoned = false;
  int rc = 0;
  addrinfo* result = nullptr;
};

// Resolves host (a name or a numeric address) for a stream or datagram
// socket; returns the getaddrinfo error code (0 on success), or
// kResolveTimedOut. getaddrinfo has no timeout and, with a DNS server that
// does not answer, waits as long as resolv.conf's timeout x attempts x
// servers x search domains allow (minutes). So a name is looked up on a
// helper thread and waited for until the deadline; a lookup that misses it
// is abandoned (the thread frees its answer when it finally gets one).
// Numeric addresses are answered here, without a thread or DNS.
// `check`, when given, is called every 50 ms while a name is looked up; an
// exception from it abandons the lookup and propagates.
int resolve(const std::string& host, const std::string& service, int socktype, int flags,
            Clock::time_point deadline, AddrList* out,
            const std::function<void()>& check = nullptr) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = socktype;
  hints.ai_flags = flags | AI_NUMERICSERV | AI_NUMERICHOST;
  const char* serv = service.empty() ? nullptr : service.c_str();
  addrinfo* result = nullptr;
  int rc = getaddrinfo(host.c_str(), serv, &hints, &result);
  if (rc != EAI_NONAME) {
    out->reset(rc == 0 ? result : nullptr);
    return rc;
  }
  hints.ai_flags = flags | AI_NUMERICSERV;
  auto lookup = std::make_shared<Lookup>();
  try {
    std::thread([lookup, host, service, hints] {
      addrinfo* found = nullptr;
      const int code = getaddrinfo(host.c_str(), service.empty() ? nullptr : service.c_str(),
                                   &hints, &found);
      std::lock_guard<std::mutex> lock(lookup->mutex);
      if (lookup->abandoned) {
        if (code == 0) freeaddrinfo(found);
        return;
      }
      lookup->rc = code;
      lookup->result = code == 0 ? found : nullptr;
      lookup->done = true;
      lookup->done_cv.notify_all();
    }).detach();
  } catch (const std::system_error& e) {
    throw NetworkError(detail::cat("cannot start a thread to resolve ", host, ": ", e.what()));
  }
  std::unique_lock<std::mutex> lock(lookup->mutex);
  for (;;) {
    const auto until = check ? std::min(deadline, Clock::now() + milliseconds(50)) : deadline;
    if (lookup->done_cv.wait_until(lock, until, [&] { return lookup->done; })) break;
    if (Clock::now() >= deadline) {
      lookup->abandoned = true;
      return kResolveTimedOut;
    }
    lock.unlock();
    try {
      check();
    } catch (...) {
      lock.lock();
      if (lookup->done && lookup->result) freeaddrinfo(lookup->result);
      lookup->abandoned = true;
      throw;
    }
    lock.lock();
  }
  out->reset(lookup->result);
  return lookup->rc;
}

// Why a host did not resolve: getaddrinfo's words, or the deadline.
std::string resolve_error(int rc) {
  if (rc == kResolveTimedOut)
    return "no answer before the deadline (is the DNS server in /etc/resolv.conf reachable?)";
  return gai_strerror(rc);
}

// resolve(), or an error "<subject> did not resolve: <why>": a TimeoutError
// at the deadline, else a `Failure`.
template <typename Failure>
AddrList resolve_or_throw(const std::string& subject, const std::string& host,
                          const std::string& service, int socktype, int flags,
                          Clock::time_point deadline, const std::function<void()>& check = nullptr) {
  AddrList list(nullptr, &freeaddrinfo);
  const int rc = resolve(host, service, socktype, flags, deadline, &list, check);
  if (rc == kResolveTimedOut)
    throw TimeoutError(detail::cat(subject, " did not resolve: ", resolve_error(rc)));
  if (rc != 0) throw Failure(detail::cat(subject, " does not resolve: ", gai_strerror(rc)));
  return list;
}

std::string errno_text(int err) { return std::strerror(err); }

// Numeric address of a sockaddr, without the port.
std::string numeric_host(const sockaddr* sa, socklen_t len) {
  char buf[NI_MAXHOST];
  if (getnameinfo(sa, len, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) != 0) return "?";
  return buf;
}

// Milliseconds until the deadline, rounded up so that poll() never wakes a
// fraction of a millisecond early and spins; 0 when it has passed.
int poll_ms(Clock::time_point deadline) {
  const auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  const auto ms = std::chrono::ceil<milliseconds>(left).count();
  return static_cast<int>(std::min<long long>(ms, 1 << 30));
}

// Waits for `events` on fd until the deadline; false on timeout.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, poll_ms(deadline));
    if (rc > 0) return true;  // readiness, or an error the next call reports
    if (rc == 0) return false;
    if (errno != EINTR) throw NetworkError(detail::cat("poll() failed: ", errno_text(errno)));
  }
}

void set_blocking(int fd, bool blocking) {
  const int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0) return;
  fcntl(fd, F_SETFL, blocking ? (flags & ~O_NONBLOCK) : (flags | O_NONBLOCK));
}

// Errors after which a later connect() may succeed: the server is not up
// yet, or the network is briefly unreachable.
bool retryable(int err) {
  return err == ECONNREFUSED || err == ENETUNREACH || err == ETIMEDOUT ||
         err == EHOSTUNREACH || err == ECONNRESET || err == EAGAIN;
}

// One non-blocking connect() attempt to one address; returns the connected
// socket or sets *err.
Fd try_connect(const addrinfo* ai, Clock::time_point deadline, int* err) {
  Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                 ai->ai_protocol));
  if (!fd) {
    *err = errno;
    return Fd();
  }
  if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
    if (errno != EINPROGRESS) {
      *err = errno;
      return Fd();
    }
    if (!wait_for(fd.get(), POLLOUT, deadline)) {
      *err = ETIMEDOUT;
      return Fd();
    }
    int so_error = 0;
    socklen_t len = sizeof(so_error);
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &so_error, &len);
    if (so_error != 0) {
      *err = so_error;
      return Fd();
    }
  }
  set_blocking(fd.get(), true);
  const int one = 1;  // store requests are small; do not let Nagle delay them
  setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

}  // namespace

Fd::~Fd() { reset(); }

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    reset();
    fd_ = o.release();
  }
  return *this;
}

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string endpoint(const std::string& host, uint16_t port) {
  if (host.find(':') != std::string::npos && host.front() != '[')
    return detail::cat("[", host, "]:", port);
  return detail::cat(host, ":", port);
}

void check_resolves(const std::string& host, const std::string& what) {
  resolve_or_throw<InvalidArgument>(what + "=" + host, host, "", SOCK_STREAM, 0, resolve_deadline());
}

uint16_t parse_port(const std::string& text, const std::string& what) {
  const bool digits = !text.empty() && text.size() <= 5 &&
                      std::all_of(text.begin(), text.end(),
                                  [](char c) { return c >= '0' && c <= '9'; });
  const long value = digits ? std::stol(text) : 0;
  DTRAIN_CHECK_ARG(value >= 1 && value <= 65535, what, "=", text,
                   " is not a valid port (expected 1..65535)");
  return static_cast<uint16_t>(value);
}

Fd listen_on(const std::string& host, uint16_t port, uint16_t* bound_port) {
  const std::string where = endpoint(host, port);
  const AddrList list = resolve_or_throw<InvalidArgument>(
      "cannot listen on " + where + ": " + host, host, std::to_string(port), SOCK_STREAM,
      AI_PASSIVE, resolve_deadline());
  int last_err = EADDRNOTAVAIL;
  for (const addrinfo* ai = list.get(); ai != nullptr; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd) {
      last_err = errno;
      continue;
    }
    // SO_REUSEADDR lets a restarted job rebind while old connections sit in
    // TIME_WAIT; it does not let two live listeners share the port on Linux.
    const int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      last_err = errno;
      // A port in use is the caller's problem to fix, not something that
      // goes away by waiting: fail at once.
      if (last_err == EADDRINUSE) break;
      continue;
    }
    if (::listen(fd.get(), SOMAXCONN) != 0) {
      last_err = errno;
      if (last_err == EADDRINUSE) break;
      continue;
    }
    if (bound_port != nullptr) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
      *bound_port = ntohs(ss.ss_family == AF_INET6
                              ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                              : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    }
    return fd;
  }
  throw NetworkError(detail::cat("cannot listen on ", where, ": ", errno_text(last_err)));
}

Fd connect_to(const std::string& host, uint16_t port, Clock::time_point deadline) {
  // Retry with a short, growing backoff: the usual case is a rank that starts
  // before the store's host is listening, so the first tries are refused.
  const auto budget_ms =
      std::chrono::round<milliseconds>(deadline - Clock::now()).count();
  const std::string where = endpoint(host, port);
  milliseconds backoff(10);
  std::string last_error = "no attempt made";
  for (;;) {
    AddrList list(nullptr, &freeaddrinfo);
    const int rc = resolve(host, std::to_string(port), SOCK_STREAM, 0, deadline, &list);
    if (rc == kResolveTimedOut)
      throw TimeoutError(detail::cat("could not connect to ", where, " within ",
                                     std::max<long long>(budget_ms, 0), " ms: ", host,
                                     " did not resolve: ", resolve_error(rc)));
    bool again = false;
    if (rc == EAI_AGAIN) {
      last_error = gai_strerror(rc);
      again = true;
    } else if (rc != 0) {
      throw NetworkError(detail::cat("cannot connect to ", where, ": ", host,
                                     " does not resolve: ", gai_strerror(rc)));
    }
    for (const addrinfo* ai = list.get(); ai != nullptr; ai = ai->ai_next) {
      int err = 0;
      Fd fd = try_connect(ai, deadline, &err);
      if (fd) return fd;
      last_error = errno_text(err);
      again = again || retryable(err);
    }
    if (!again)
      throw NetworkError(detail::cat("cannot connect to ", where, ": ", last_error));
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero())
      throw TimeoutError(detail::cat("could not connect to ", where, " within ",
                                     std::max<long long>(budget_ms, 0), " ms: ", last_error));
    std::this_thread::sleep_for(
        std::min<Clock::duration>(backoff, left));
    backoff = std::min(backoff * 2, milliseconds(200));
  }
}

void send_all(int fd, const void* data, size_t n, Clock::time_point deadline,
              const std::string& peer) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    // MSG_DONTWAIT makes this correct for blocking and non-blocking sockets
    // alike; MSG_NOSIGNAL turns a dead peer into EPIPE instead of SIGPIPE.
    const ssize_t sent = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent > 0) {
      p += sent;
      n -= static_cast<size_t>(sent);
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
      throw NetworkError(detail::cat("send to ", peer, " failed: ", errno_text(errno)));
    if (!wait_for(fd, POLLOUT, deadline))
      throw TimeoutError(detail::cat("timed out sending to ", peer));
  }
}

void recv_all(int fd, void* data, size_t n, Clock::time_point deadline,
              const std::string& peer) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    const ssize_t got = ::recv(fd, p, n, MSG_DONTWAIT);
    if (got > 0) {
      p += got;
      n -= static_cast<size_t>(got);
      continue;
    }
    if (got == 0) throw NetworkError(detail::cat("connection closed by ", peer));
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      throw NetworkError(detail::cat("receive from ", peer, " failed: ", errno_text(errno)));
    if (!wait_for(fd, POLLIN, deadline))
      throw TimeoutError(detail::cat("timed out receiving from ", peer));
  }
}

std::string local_address_towards(const std::string& host) {
  return local_address_towards(host, resolve_deadline(), nullptr);
}

std::string local_address_towards(const std::string& host, Clock::time_point deadline,
                                  const std::function<void()>& check) {
  // connect() on a UDP socket only asks the routing table which source
  // address it would use; no packet leaves the machine.
  const AddrList list = resolve_or_throw<NetworkError>(
      "cannot find a local address towards " + host + ": " + host, host, "9", SOCK_DGRAM, 0,
      deadline, check);
  int last_err = ENETUNREACH;
  for (const addrinfo* ai = list.get(); ai != nullptr; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!fd || ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      last_err = errno;
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len) != 0) {
      last_err = errno;
      continue;
    }
    return numeric_host(reinterpret_cast<sockaddr*>(&ss), len);
  }
  throw NetworkError(detail::cat("cannot find a local address towards ", host, ": ",
                                 errno_text(last_err)));
}

std::string interface_address(const std::string& ifname) {
  ifaddrs* raw = nullptr;
  if (getifaddrs(&raw) != 0)
    throw NetworkError(detail::cat("getifaddrs() failed: ", errno_text(errno)));
  std::unique_ptr<ifaddrs, decltype(&freeifaddrs)> list(raw, &freeifaddrs);
  // Prefer IPv4, then a global IPv6 address, then a link-local one (which
  // getnameinfo prints with its %scope so that it stays usable).
  std::string v6, v6_link_local, names;
  for (const ifaddrs* ifa = list.get(); ifa != nullptr; ifa = ifa->ifa_next) {
    if (ifa->ifa_addr == nullptr) continue;
    const int family = ifa->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    if (names.find(detail::cat(" ", ifa->ifa_name, ",")) == std::string::npos)
      names += detail::cat(" ", ifa->ifa_name, ",");
    if (ifname != ifa->ifa_name) continue;
    if (family == AF_INET) return numeric_host(ifa->ifa_addr, sizeof(sockaddr_in));
    const auto* sin6 = reinterpret_cast<const sockaddr_in6*>(ifa->ifa_addr);
    std::string& slot = IN6_IS_ADDR_LINKLOCAL(&sin6->sin6_addr) ? v6_link_local : v6;
    if (slot.empty()) slot = numeric_host(ifa->ifa_addr, sizeof(sockaddr_in6));
  }
  if (!v6.empty()) return v6;
  if (!v6_link_local.empty()) return v6_link_local;
  if (!names.empty()) names.pop_back();  // trailing comma
  throw InvalidArgument(detail::cat("network interface '", ifname,
                                    "' does not exist or has no IPv4/IPv6 address "
                                    "(interfaces with addresses:", names, ")"));
}

bool is_loopback(const std::string& host) {
  std::string h = host;
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  std::string lower = h;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "localhost") return true;
  in_addr v4{};
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    // ::ffff:127.x.y.z is IPv4 loopback seen through an IPv6 socket.
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return false;
}

void raise_open_file_limit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    setrlimit(RLIMIT_NOFILE, &lim);
  }
}

}  // namespace dtrain::net
