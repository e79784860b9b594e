// TCP-specific behaviour of the store: binding, connecting, worker counting,
// hostile input on the port, slow clients, server loss, client deadlines;
// and the socket helpers underneath (src/common/socket.h).

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>

#include "harness/assertions.h"
#include "harness/raw_socket.h"
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <future>
#include <numeric>
#include <random>
#include <thread>

#include "common/socket.h"
#include "dtrain/errors.h"
#include "dtrain/store/tcp_store.h"
#include "store/tcp_store_server.h"
#include "store/wire.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using ms = std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

using testing::Contains;
using testing::seconds_since;
using testing::closed_by_server;
using testing::raw_connect;

TcpStoreOptions server_options(ms timeout = 5s) {
  return TcpStoreOptions().host("127.0.0.1").port(0).is_server(true).timeout(timeout);
}

std::unique_ptr<TcpStore> client_of(uint16_t port, ms timeout = 5s) {
  return std::make_unique<TcpStore>(TcpStoreOptions().host("127.0.0.1").port(port).timeout(timeout));
}

// A port nothing listens on right now (bound, read back, released).
uint16_t unused_port() {
  uint16_t port = 0;
  net::listen_on("127.0.0.1", 0, &port);
  return port;
}

// A port bound (without SO_REUSEADDR) but not listening, for as long as it
// lives: connections to it are refused, and no other socket, of this test
// or of a test running beside it, can take the port meanwhile.
class RefusingPort {
 public:
  RefusingPort() : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    socklen_t len = sizeof(addr);
    getsockname(fd_.get(), reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  uint16_t port() const { return port_; }

 private:
  net::Fd fd_;
  uint16_t port_ = 0;
};

std::vector<uint8_t> header(uint32_t magic, uint16_t version, uint16_t opcode, uint32_t length) {
  std::vector<uint8_t> h(16, 0);
  for (int i = 0; i < 4; ++i) h[i] = uint8_t(magic >> (8 * i));
  h[4] = uint8_t(version);
  h[5] = uint8_t(version >> 8);
  h[6] = uint8_t(opcode);
  h[7] = uint8_t(opcode >> 8);
  for (int i = 0; i < 4; ++i) h[8 + i] = uint8_t(length >> (8 * i));
  return h;
}

// A well-formed SET of "k" = "v" (so that only the header is wrong).
std::vector<uint8_t> valid_set(uint32_t magic, uint16_t version, uint16_t opcode) {
  auto frame = wire::Writer(wire::kSet, 1).str("k").str("v").finish();
  const auto h = header(magic, version, opcode, uint32_t(frame.size() - 16));
  std::copy(h.begin(), h.begin() + 12, frame.begin());
  return frame;
}

long resident_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return 0;
}

TEST(TcpStore, PortInUseFailsAtOnceNamingTheAddress) {
  TcpStore first(server_options());
  const std::string where = "127.0.0.1:" + std::to_string(first.port());
  const auto start = Clock::now();
  try {
    TcpStore second(server_options().port(first.port()));
    FAIL() << "a second server bound " << where;
  } catch (const NetworkError& e) {
    EXPECT_TRUE(Contains(e.what(), "cannot listen on " + where + ": Address already in use"));
  }
  EXPECT_LT(seconds_since(start), 1.0);
}

TEST(TcpStore, PortZeroPicksAFreePort) {
  TcpStore a(server_options()), b(server_options());
  EXPECT_NE(a.port(), 0);
  EXPECT_NE(b.port(), 0);
  EXPECT_NE(a.port(), b.port());
  auto client = client_of(a.port());
  client->set("k", "v");
  EXPECT_EQ(a.get_string("k"), "v");
  EXPECT_THROW(TcpStore(TcpStoreOptions().port(0)), InvalidArgument);  // port 0 needs is_server
}

TEST(TcpStore, ClientWithNoServerTimesOutNamingHostPort) {
  RefusingPort refusing;
  const uint16_t port = refusing.port();
  const auto start = Clock::now();
  try {
    client_of(port, 500ms);
    FAIL() << "connected to a port nobody listens on";
  } catch (const TimeoutError& e) {
    EXPECT_TRUE(Contains(e.what(), "could not connect to 127.0.0.1:" + std::to_string(port) +
                                    " within 500 ms: Connection refused"));
  }
  const double elapsed = seconds_since(start);
  EXPECT_GE(elapsed, 0.4);
  EXPECT_LT(elapsed, 3.0);
}

TEST(TcpStore, ClientStartedBeforeTheServerConnectsOnceItIsUp) {
  const uint16_t port = unused_port();
  auto client = std::async(std::launch::async, [&] { return client_of(port, 10s); });
  TcpStore server(server_options().port(port));
  auto c = client.get();
  c->set("early", "bird");
  EXPECT_EQ(server.get_string("early"), "bird");
}

TEST(TcpStore, WaitWorkersSucceedsWhenAllJoin) {
  const uint16_t port = unused_port();
  auto worker = std::async(std::launch::async, [&] {
    return std::make_unique<TcpStore>(TcpStoreOptions().port(port).num_workers(2).timeout(10s));
  });
  TcpStore server(server_options(10s).port(port).num_workers(2));
  auto w = worker.get();
  EXPECT_EQ(server.num_keys(), 0);  // the worker counter is internal
  EXPECT_EQ(w->num_keys(), 0);
}

TEST(TcpStore, WaitWorkersTimesOutSayingHowManyJoined) {
  const uint16_t port = unused_port();
  // One worker joins (the server's own client is the other): 2 of 3.
  auto worker = std::async(std::launch::async, [&] {
    return std::make_unique<TcpStore>(TcpStoreOptions().port(port).num_workers(3).timeout(10s));
  });
  const auto start = Clock::now();
  try {
    TcpStore server(server_options(1500ms).port(port).num_workers(3));
    FAIL() << "the server did not notice a missing worker";
  } catch (const TimeoutError& e) {
    EXPECT_EQ(std::string(e.what()), "TCP store 127.0.0.1:" + std::to_string(port) +
                                         ": timed out after 1500 ms waiting for workers: "
                                         "2/3 joined");
  }
  const double elapsed = seconds_since(start);
  EXPECT_GE(elapsed, 1.4);
  EXPECT_LT(elapsed, 4.0);
  worker.get();  // it joined and returned (workers do not wait)
}

TEST(TcpStore, GetTimeoutIsDecidedByTheServerAndTheClientGoesOn) {
  TcpStore server(server_options());
  auto client = client_of(server.port(), 300ms);
  const auto start = Clock::now();
  try {
    client->get("foo");
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_EQ(std::string(e.what()), "TCP store 127.0.0.1:" + std::to_string(server.port()) +
                                         ": timed out after 300 ms waiting for key 'foo'");
  }
  const double elapsed = seconds_since(start);
  EXPECT_GE(elapsed, 0.29);
  EXPECT_LT(elapsed, 1.5);  // the server's TIMEOUT reply, not the client's grace period
  client->set("foo", "bar");
  EXPECT_EQ(client->get_string("foo"), "bar");
}

TEST(TcpStore, GarbageOnThePortDropsOnlyThatConnection) {
  TcpStore server(server_options());
  auto client = client_of(server.port());
  client->set("before", "1");

  std::mt19937 rng(12345);
  std::vector<uint8_t> random_bytes(4096);
  for (auto& b : random_bytes) b = uint8_t(rng());
  std::vector<uint8_t> set_overrun = header(wire::kMagic, wire::kVersion, wire::kSet, 8);
  // A key declared 1000 bytes long, in an 8-byte payload.
  for (uint8_t b : std::initializer_list<uint8_t>{0xe8, 0x03, 0, 0, 'a', 'b', 'c', 'd'})
    set_overrun.push_back(b);
  const std::vector<std::pair<std::string, std::vector<uint8_t>>> attacks = {
      {"random 4 KiB", random_bytes},
      {"wrong magic", valid_set(0x12345678, wire::kVersion, wire::kSet)},
      {"wrong version", valid_set(wire::kMagic, 99, wire::kSet)},
      {"unknown opcode", valid_set(wire::kMagic, wire::kVersion, 77)},
      {"4 GiB length", header(wire::kMagic, wire::kVersion, wire::kSet, 0xffffffffu)},
      {"64 MiB + 1 length", header(wire::kMagic, wire::kVersion, wire::kSet, (64u << 20) + 1)},
      {"field overruns the frame", set_overrun},
  };
  const long rss_before = resident_kib();
  for (const auto& [name, data] : attacks) {
    net::Fd sock = raw_connect(server.port());
    net::send_all(sock.get(), data.data(), data.size(), Clock::now() + 2s, "server");
    EXPECT_TRUE(closed_by_server(sock.get())) << name;
    client->set("after", name);  // the real client is unaffected
    EXPECT_EQ(client->get_string("after"), name);
  }
  // The huge declared lengths were refused without allocating them.
  EXPECT_LT(resident_kib() - rss_before, 32 * 1024);
  EXPECT_EQ(client->get_string("before"), "1");
  EXPECT_EQ(client_of(server.port())->get_string("before"), "1");  // new clients too
}

TEST(TcpStore, AnIdleHalfHeaderClientDoesNotDelayOthers) {
  TcpStore server(server_options());
  net::Fd slow = raw_connect(server.port());
  const auto half = header(wire::kMagic, wire::kVersion, wire::kGet, 100);
  net::send_all(slow.get(), half.data(), 8, Clock::now() + 2s, "server");
  auto client = client_of(server.port());
  const auto start = Clock::now();
  for (int i = 0; i < 100; ++i) {
    client->set("k" + std::to_string(i), std::to_string(i));
    EXPECT_EQ(client->get_string("k" + std::to_string(i)), std::to_string(i));
  }
  EXPECT_LT(seconds_since(start), 1.0);
  pollfd p{slow.get(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 0), 0) << "the server should simply keep waiting for the rest";
}

TEST(TcpStore, SixteenClientsAddingConcurrentlyGiveTheExactTotal) {
  TcpStore server(server_options());
  constexpr int kClients = 16, kAdds = 100;
  std::vector<std::thread> threads;
  std::vector<std::vector<int64_t>> seen(kClients);
  for (int t = 0; t < kClients; ++t)
    threads.emplace_back([&, t] {
      auto c = client_of(server.port());
      for (int i = 0; i < kAdds; ++i) seen[t].push_back(c->add("sum", 1));
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(server.get_string("sum"), std::to_string(kClients * kAdds));
  std::vector<int64_t> all;
  for (const auto& s : seen) all.insert(all.end(), s.begin(), s.end());
  std::sort(all.begin(), all.end());
  std::vector<int64_t> expected(kClients * kAdds);
  std::iota(expected.begin(), expected.end(), 1);
  EXPECT_EQ(all, expected);
}

TEST(TcpStore, ServerDestroyedWhileAClientWaitsFailsTheClientPromptly) {
  auto server = std::make_unique<TcpStoreServer>("127.0.0.1", 0);
  auto client = client_of(server->port(), 10s);
  auto waiting = std::async(std::launch::async, [&] {
    try {
      client->get("never");
      return std::string("returned");
    } catch (const NetworkError& e) {
      return std::string("NetworkError: ") + e.what();
    } catch (const TimeoutError& e) {
      return std::string("TimeoutError: ") + e.what();
    }
  });
  // Wait for the request to be parked on the server (a condition, polled).
  const auto deadline = Clock::now() + 5s;
  while (server->parked_requests() == 0 && Clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  ASSERT_EQ(server->parked_requests(), 1u);
  const auto start = Clock::now();
  server.reset();
  ASSERT_EQ(waiting.wait_for(3s), std::future_status::ready) << "client hangs";
  EXPECT_LT(seconds_since(start), 2.0);
  const std::string outcome = waiting.get();
  EXPECT_TRUE(outcome.rfind("NetworkError: ", 0) == 0 || outcome.rfind("TimeoutError: ", 0) == 0)
      << outcome;
  EXPECT_TRUE(Contains(outcome, "'never'"));
}

// A listener that accepts (in the kernel) but never answers: the client's
// connection check at construction times out.
TEST(TcpStore, ASilentServerIsATimeoutAtConnection) {
  uint16_t port = 0;
  net::Fd mute = net::listen_on("127.0.0.1", 0, &port);
  const auto start = Clock::now();
  try {
    client_of(port, 300ms);
    FAIL() << "connected to a server that never answers";
  } catch (const TimeoutError& e) {
    EXPECT_TRUE(Contains(e.what(), "TCP store: ")) << e.what();
    EXPECT_TRUE(Contains(e.what(), "127.0.0.1:" + std::to_string(port))) << e.what();
  }
  EXPECT_LT(seconds_since(start), 1.5);
}

// A server that answers each connection's check, then falls silent.
class GoesSilentServer {
 public:
  GoesSilentServer() : listener_(net::listen_on("127.0.0.1", 0, &port_)) {
    thread_ = std::thread([this] {
      while (!stop_) {
        pollfd p{listener_.get(), POLLIN, 0};
        if (::poll(&p, 1, 50) <= 0) continue;
        net::Fd c(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
        uint8_t hello[wire::kHeaderBytes];
        net::recv_all(c.get(), hello, sizeof(hello), Clock::now() + 2s, "client");
        auto reply = wire::Writer(wire::kOk, wire::decode_header(hello).request_id).i64(0).finish();
        net::send_all(c.get(), reply.data(), reply.size(), Clock::now() + 2s, "client");
        held_.push_back(std::move(c));
      }
    });
  }
  ~GoesSilentServer() {
    stop_ = true;
    thread_.join();
  }
  uint16_t port() const { return port_; }
  size_t connections() {
    stop_ = true;
    thread_.join();
    thread_ = std::thread([] {});
    return held_.size();
  }

 private:
  uint16_t port_ = 0;
  net::Fd listener_;
  std::atomic<bool> stop_{false};
  std::vector<net::Fd> held_;
  std::thread thread_;
};

TEST(TcpStore, ASilentServerBecomesATimeoutAndTheClientReconnects) {
  GoesSilentServer server;
  auto client = client_of(server.port(), 300ms);
  const auto start = Clock::now();
  try {
    client->set("k", "v");
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_EQ(std::string(e.what()), "TCP store 127.0.0.1:" + std::to_string(server.port()) +
                                         ": no reply to SET of key 'k' within 300 ms "
                                         "(server stopped or unreachable)");
  }
  const double elapsed = seconds_since(start);
  EXPECT_GE(elapsed, 0.29);
  EXPECT_LT(elapsed, 1.5);
  // GET waits its timeout plus the grace period for the server's verdict.
  EXPECT_THROW(client->get("k"), TimeoutError);
  EXPECT_GE(seconds_since(start), 0.29 + 0.3 + 2.0 - 0.05);
  // Each failed call dropped its socket: the second call came on a new
  // connection, so a late reply could never be mistaken for a later answer.
  EXPECT_EQ(server.connections(), 2u);
}

TEST(TcpStore, OversizedKeysAndValuesAreInvalidArgument) {
  TcpStore server(server_options());
  try {
    server.set(std::string(64 * 1024 + 1, 'k'), "v");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(Contains(e.what(), "key of 65537 bytes is over the limit of 65536 bytes"));
  }
  try {
    server.set("big", std::vector<uint8_t>(TcpStore::kMaxFrameBytes, 0));
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(Contains(e.what(), "SET of key 'big': request of 67108875 bytes is over the "
                                    "frame limit of 67108864 bytes"));
  }
  std::vector<uint8_t> large(8 << 20, 7);  // well within the limit: goes through
  server.set("large", large);
  EXPECT_EQ(server.get("large"), large);
}

TEST(TcpStore, WaitTimeoutNamesOnlyTheMissingKeys) {
  TcpStore server(server_options());
  server.set("here", "1");
  try {
    server.wait({"here", "gone1", "gone2"}, 200ms);
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_EQ(std::string(e.what()), "TCP store 127.0.0.1:" + std::to_string(server.port()) +
                                         ": timed out after 200 ms waiting for keys "
                                         "'gone1', 'gone2'");
  }
}

TEST(TcpStore, ServesIPv6) {
  std::unique_ptr<TcpStore> server;
  try {
    server = std::make_unique<TcpStore>(server_options().host("::1"));
  } catch (const NetworkError& e) {
    GTEST_SKIP() << "no IPv6 loopback on this machine: " << e.what();
  }
  auto client = std::make_unique<TcpStore>(
      TcpStoreOptions().host("::1").port(server->port()).timeout(5s));
  client->set("six", "6");
  EXPECT_EQ(server->get_string("six"), "6");
}

TEST(TcpStoreServer, BindsExactlyTheGivenAddress) {
  TcpStoreServer server("127.0.0.1", 0);
  EXPECT_EQ(server.bound_address(), "127.0.0.1");  // not 0.0.0.0
}

TEST(TcpStoreServer, IsNotReachableThroughAnotherLocalAddress) {
  std::string other;
  ifaddrs* list = nullptr;
  ASSERT_EQ(getifaddrs(&list), 0);
  for (ifaddrs* i = list; i != nullptr && other.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    char buf[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof(buf));
    if (!net::is_loopback(buf)) other = buf;
  }
  freeifaddrs(list);
  if (other.empty())
    GTEST_SKIP() << "this machine has no non-loopback IPv4 address, so there is no second "
                    "address to try the loopback-bound server through";
  TcpStoreServer server("127.0.0.1", 0);
  try {
    net::connect_to(other, server.port(), Clock::now() + 200ms);
    FAIL() << "reached a 127.0.0.1-bound server through " << other;
  } catch (const TimeoutError& e) {
    EXPECT_TRUE(Contains(e.what(), "Connection refused"));
  }
}

// ---- socket helpers -----------------------------------------------------------

TEST(Socket, ParsePortAcceptsOnlyDecimalPorts) {
  EXPECT_EQ(net::parse_port("1", "MASTER_PORT"), 1);
  EXPECT_EQ(net::parse_port("29500", "MASTER_PORT"), 29500);
  EXPECT_EQ(net::parse_port("65535", "MASTER_PORT"), 65535);
  for (const char* bad : {"0", "65536", "", "abc", "-1", "+1", " 80", "80 ", "0x50", "123456"}) {
    try {
      net::parse_port(bad, "MASTER_PORT");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()),
                std::string("MASTER_PORT=") + bad + " is not a valid port (expected 1..65535)");
    }
  }
}

TEST(Socket, EndpointBracketsIPv6) {
  EXPECT_EQ(net::endpoint("10.0.0.1", 29500), "10.0.0.1:29500");
  EXPECT_EQ(net::endpoint("::1", 80), "[::1]:80");
  EXPECT_EQ(net::endpoint("node7", 1), "node7:1");
}

TEST(Socket, IsLoopback) {
  for (const char* yes : {"127.0.0.1", "127.1.2.3", "::1", "localhost", "LocalHost", "[::1]",
                          "::ffff:127.0.0.1"})
    EXPECT_TRUE(net::is_loopback(yes)) << yes;
  for (const char* no : {"10.0.0.1", "128.0.0.1", "::2", "0.0.0.0", "node1", ""})
    EXPECT_FALSE(net::is_loopback(no)) << no;
}

TEST(Socket, CheckResolvesNamesTheVariable) {
  net::check_resolves("127.0.0.1", "MASTER_ADDR");
  net::check_resolves("localhost", "MASTER_ADDR");
  try {
    net::check_resolves("no-such-host.invalid", "MASTER_ADDR");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(Contains(e.what(), "MASTER_ADDR=no-such-host.invalid does not resolve: "));
  }
}

TEST(Socket, LocalAndInterfaceAddresses) {
  EXPECT_EQ(net::local_address_towards("127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(net::interface_address("lo"), "127.0.0.1");
  try {
    net::interface_address("nosuch0");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(Contains(e.what(), "network interface 'nosuch0' does not exist"));
    EXPECT_TRUE(Contains(e.what(), "lo"));
  }
}

TEST(Socket, SendAndReceiveRespectDeadlines) {
  uint16_t port = 0;
  net::Fd listener = net::listen_on("127.0.0.1", 0, &port);
  net::Fd a = raw_connect(port);
  net::Fd b(accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  ASSERT_TRUE(b);
  const char msg[] = "ping";
  net::send_all(a.get(), msg, 4, Clock::now() + 1s, "b");
  char got[4];
  net::recv_all(b.get(), got, 4, Clock::now() + 1s, "a");
  EXPECT_EQ(std::string(got, 4), "ping");
  const auto start = Clock::now();
  EXPECT_THROW(net::recv_all(b.get(), got, 1, Clock::now() + 100ms, "a"), TimeoutError);
  EXPECT_GE(seconds_since(start), 0.09);
  a.reset();
  try {
    net::recv_all(b.get(), got, 1, Clock::now() + 1s, "peer 1.2.3.4:5");
    FAIL();
  } catch (const NetworkError& e) {
    EXPECT_EQ(std::string(e.what()), "connection closed by peer 1.2.3.4:5");
  }
}

}  // namespace
}  // namespace dtrain
