// Name resolution keeps the caller's deadline even when the DNS server never
// answers. A child process gets network and mount namespaces of its own, in
// which /etc/resolv.conf names a DNS server on 127.0.0.1:53 that receives
// queries and never replies, with settings under which glibc alone would
// wait 30 s x 5 attempts. Needs root or unprivileged user namespaces (as CI
// has); failing to set them up fails the test, never skips it.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>

#include "common/socket.h"
#include "dtrain/errors.h"
#include "harness/assertions.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::Contains;

constexpr const char* kName = "dtrain-resolve-test.example.com";

// In this (child) process: own network and mount namespaces, loopback up, a
// silent DNS server on 127.0.0.1:53 and a resolv.conf pointing at it.
// Returns "" or what failed.
std::string enter_dead_dns_world(const std::string& resolv_conf) {
  if (::unshare(CLONE_NEWNET | CLONE_NEWNS) != 0 &&
      ::unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS) != 0)
    return std::string("unshare: ") + std::strerror(errno) +
           " (this test needs root or unprivileged user namespaces)";
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0)
    return std::string("making / private: ") + std::strerror(errno);
  const int s = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  ifreq ifr{};
  std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
  if (::ioctl(s, SIOCGIFFLAGS, &ifr) != 0) return std::string("SIOCGIFFLAGS: ") + std::strerror(errno);
  ifr.ifr_flags |= IFF_UP;
  if (::ioctl(s, SIOCSIFFLAGS, &ifr) != 0) return std::string("lo up: ") + std::strerror(errno);
  sockaddr_in dns{};
  dns.sin_family = AF_INET;
  dns.sin_port = htons(53);
  dns.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // Bound and never read: queries are accepted and left unanswered (no ICMP
  // "port unreachable" that would let the resolver give up early).
  if (::bind(s, reinterpret_cast<sockaddr*>(&dns), sizeof(dns)) != 0)
    return std::string("binding the silent DNS server: ") + std::strerror(errno);
  if (::mount(resolv_conf.c_str(), "/etc/resolv.conf", nullptr, MS_BIND, nullptr) != 0)
    return std::string("bind-mounting resolv.conf: ") + std::strerror(errno);
  return "";
}

// What `fn` throws, as "TimeoutError: <what>" (or another type's name), and
// how long it took, as "<ms> ms | ...".
std::string describe_call(const std::function<void()>& fn) {
  const auto start = Clock::now();
  std::string what = "returned";
  try {
    fn();
  } catch (const TimeoutError& e) {
    what = std::string("TimeoutError: ") + e.what();
  } catch (const std::exception& e) {
    what = std::string("other error: ") + e.what();
  }
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  return std::to_string(ms.count()) + " ms | " + what;
}

// Runs `body` in the child; returns what it wrote, or fails the test when
// the child has not finished after `limit`.
std::string in_dead_dns_world(const std::function<std::string()>& body,
                              std::chrono::seconds limit) {
  char conf[] = "/tmp/dtrain-resolv-XXXXXX";
  const int conf_fd = ::mkstemp(conf);
  EXPECT_GE(conf_fd, 0);
  const std::string text = "nameserver 127.0.0.1\noptions timeout:30 attempts:5\n";
  EXPECT_EQ(::write(conf_fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
  ::close(conf_fd);
  int out[2];
  EXPECT_EQ(::pipe(out), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(out[0]);
    std::string report = enter_dead_dns_world(conf);
    report = report.empty() ? body() : "setup failed: " + report;
    (void)!::write(out[1], report.data(), report.size());
    ::_exit(0);
  }
  ::close(out[1]);
  std::string report;
  const auto deadline = Clock::now() + limit;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    pollfd p{out[0], POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) == 0) {
      ADD_FAILURE() << "still blocked " << limit.count() << " s after starting (got so far: "
                    << report << ")";
      break;
    }
    char buf[512];
    const ssize_t n = ::read(out[0], buf, sizeof(buf));
    if (n <= 0) break;
    report.append(buf, static_cast<size_t>(n));
  }
  ::close(out[0]);
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  ::unlink(conf);
  return report;
}

// The number before " ms | " in a describe_call() line.
long long ms_of(const std::string& line) { return std::stoll(line.substr(0, line.find(' '))); }

TEST(Resolve, ConnectGivesUpAtItsDeadlineWhenTheDnsServerNeverAnswers) {
  const auto report = in_dead_dns_world([] {
    return describe_call([] { net::connect_to(kName, 29500, net::Clock::now() + 1s); });
  }, 20s);
  ASSERT_FALSE(report.empty());
  EXPECT_TRUE(Contains(report, std::string("TimeoutError: could not connect to ") + kName +
                                   ":29500 within 1000 ms: " + kName +
                                   " did not resolve: no answer before the deadline (is the DNS "
                                   "server in /etc/resolv.conf reachable?)"));
  if (report.find(" ms | ") != std::string::npos) {
    EXPECT_GE(ms_of(report), 900) << report;
    EXPECT_LT(ms_of(report), 2500) << report;
  }
}

TEST(Resolve, NumericAddressesNeverAskTheDnsServer) {
  const auto report = in_dead_dns_world([] {
    return describe_call([] {
      uint16_t port = 0;
      auto listener = net::listen_on("127.0.0.1", 0, &port);
      net::connect_to("127.0.0.1", port, net::Clock::now() + 5s);
      net::check_resolves("::1", "MASTER_ADDR");
    });
  }, 20s);
  EXPECT_TRUE(Contains(report, " ms | returned"));
  if (report.find(" ms | ") != std::string::npos) EXPECT_LT(ms_of(report), 500) << report;
}

}  // namespace
}  // namespace dtrain
