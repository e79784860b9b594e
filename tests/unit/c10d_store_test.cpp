// The TCP store server speaking PyTorch's c10d TCPStore protocol, byte by
// byte as PyTorch's clients send it (v2: PyTorch 2.2 and newer, opening with
// VALIDATE; v1: 1.13/2.0), beside dtrain's own clients on the same keys; and
// hostile c10d requests. (tcp_test.cpp drives it with libtorch's own client.)

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <thread>
#include <string>
#include <vector>

#include "dtrain/store/tcp_store.h"
#include "harness/raw_socket.h"
#include "store/c10d_wire.h"
#include "store/tcp_store_server.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::closed_by_server;
using testing::raw_connect;
using testing::read_available;

// One c10d request: query byte then fields, as PyTorch's client lays them out.
struct Req {
  std::vector<uint8_t> b;
  explicit Req(uint8_t q) { b.push_back(q); }
  template <typename T>
  Req& val(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
    return *this;
  }
  Req& str(const std::string& s) {
    val<uint64_t>(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
};

// v2 numbering (PyTorch 2.2+).
enum V2 : uint8_t { kValidate, kSet, kCompareSet, kGet, kAdd, kCheck, kWait, kNumKeys, kDelete,
                    kAppend, kMultiGet, kMultiSet, kCancelWait, kPing, kQueuePush = 14 };

class C10dClient {
 public:
  C10dClient(uint16_t port, bool v2) : fd_(raw_connect(port)) {
    if (v2) send(Req(kValidate).val<uint32_t>(c10d_wire::kValidateMagic));
  }
  void send(const Req& r) {
    net::send_all(fd_.get(), r.b.data(), r.b.size(), net::Clock::now() + 2s, "server");
  }
  std::vector<uint8_t> recv(size_t n) {
    std::vector<uint8_t> out(n);
    net::recv_all(fd_.get(), out.data(), n, net::Clock::now() + 2s, "server");
    return out;
  }
  template <typename T>
  T recv_val() {
    T v;
    auto bytes = recv(sizeof(T));
    std::memcpy(&v, bytes.data(), sizeof(T));
    return v;
  }
  std::string recv_str() {
    const auto n = recv_val<uint64_t>();
    auto bytes = recv(n);
    return std::string(bytes.begin(), bytes.end());
  }
  int fd() const { return fd_.get(); }

 private:
  net::Fd fd_;
};

// Sanitizers slow the server several times over; time bounds scale with them.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr int kSlowdown = 10;
#else
constexpr int kSlowdown = 1;
#endif

std::unique_ptr<TcpStore> make_server() {
  return std::make_unique<TcpStore>(
      TcpStoreOptions().host("127.0.0.1").port(0).is_server(true).timeout(5s));
}

TEST(C10dStore, V2ClientHandshakesAndSharesKeysWithDtrainClients) {
  auto owned = make_server();
  TcpStore& server = *owned;
  C10dClient c(server.port(), /*v2=*/true);
  c.send(Req(kPing).val<uint32_t>(4242));
  EXPECT_EQ(c.recv_val<uint32_t>(), 4242u);

  c.send(Req(kSet).str("/from_torch").str("hello"));
  EXPECT_EQ(server.get_string("/from_torch"), "hello");
  server.set("/from_dtrain", "world");
  c.send(Req(kGet).str("/from_dtrain"));
  EXPECT_EQ(c.recv_str(), "world");

  c.send(Req(kAdd).str("init/").val<int64_t>(1));
  EXPECT_EQ(c.recv_val<int64_t>(), 1);
  EXPECT_EQ(server.add("init/", 2), 3);  // both see one decimal counter

  c.send(Req(kCompareSet).str("/cas").str("").str("first"));
  EXPECT_EQ(c.recv_str(), "first");
  c.send(Req(kCompareSet).str("/cas").str("wrong").str("second"));
  EXPECT_EQ(c.recv_str(), "first");

  c.send(Req(kCheck).val<uint64_t>(2).str("/cas").str("/absent"));
  EXPECT_EQ(c.recv_val<uint8_t>(), c10d_wire::kCheckNotReady);
  c.send(Req(kAppend).str("/cas").str("+more"));
  c.send(Req(kMultiGet).val<uint64_t>(2).str("/cas").str("/from_torch"));
  EXPECT_EQ(c.recv_str(), "first+more");
  EXPECT_EQ(c.recv_str(), "hello");
  c.send(Req(kMultiSet).val<int64_t>(2).str("/m1").str("a").str("/m2").str("b"));
  EXPECT_EQ(server.get_string("/m2"), "b");

  c.send(Req(kDelete).str("/m1"));
  EXPECT_EQ(c.recv_val<int64_t>(), 1);
  c.send(Req(kNumKeys));
  EXPECT_EQ(c.recv_val<int64_t>(), server.num_keys());
}

TEST(C10dStore, WaitIsAnsweredWhenTheKeyAppearsAndCancelLeavesNoLateAnswer) {
  auto owned = make_server();
  TcpStore& server = *owned;
  C10dClient c(server.port(), true);
  c.send(Req(kWait).val<uint64_t>(1).str("/later"));
  EXPECT_TRUE(read_available(c.fd(), 200ms).empty()) << "answered before the key exists";
  server.set("/later", "x");
  EXPECT_EQ(c.recv_val<uint8_t>(), c10d_wire::kStopWaiting);

  // A client whose wait timed out cancels it: WAIT_CANCELED, and nothing
  // after it when the key finally appears.
  c.send(Req(kWait).val<uint64_t>(1).str("/never"));
  c.send(Req(kCancelWait));
  EXPECT_EQ(c.recv_val<uint8_t>(), c10d_wire::kWaitCanceled);
  server.set("/never", "now");
  EXPECT_TRUE(read_available(c.fd(), 200ms).empty());
  c.send(Req(kPing).val<uint32_t>(7));  // still in step
  EXPECT_EQ(c.recv_val<uint32_t>(), 7u);
}

TEST(C10dStore, V1ClientWithoutHandshakeIsServed) {
  auto owned = make_server();
  TcpStore& server = *owned;
  C10dClient c(server.port(), /*v2=*/false);
  // v1 numbering: SET=0, GET=2, ADD=3, WAIT=5.
  c.send(Req(3).str("init/").val<int64_t>(1));
  EXPECT_EQ(c.recv_val<int64_t>(), 1);
  c.send(Req(0).str("/k").str("v1 value"));
  c.send(Req(5).val<uint64_t>(1).str("/k"));
  EXPECT_EQ(c.recv_val<uint8_t>(), c10d_wire::kStopWaiting);
  c.send(Req(2).str("/k"));
  EXPECT_EQ(c.recv_str(), "v1 value");
  // A v1 SET whose first bytes are 00 is not mistaken for v2's VALIDATE.
  C10dClient first_set(server.port(), false);
  first_set.send(Req(0).str("/first").str("set"));
  EXPECT_EQ(server.get_string("/first"), "set");
}

TEST(C10dStore, HostileRequestsDropOnlyThatClient) {
  auto owned = make_server();
  TcpStore& server = *owned;
  server.set("/keep", "1");
  Req key_bomb(kSet);
  key_bomb.val<uint64_t>(uint64_t(1) << 62);
  const std::vector<std::pair<std::string, Req>> attacks = {
      {"key of 2^62 bytes", key_bomb},
      {"value over 64 MiB", Req(kSet).str("/k").val<uint64_t>((64u << 20) + 1)},
      {"a million keys", Req(kCheck).val<uint64_t>(1u << 20)},
      {"GET of a missing key", Req(kGet).str("/missing")},
      {"queue ops", Req(kQueuePush).str("/q").str("x")},
      {"unknown query type", Req(200)},
      {"wrong VALIDATE magic", Req(kValidate).val<uint32_t>(1)},
  };
  for (const auto& [name, req] : attacks) {
    C10dClient c(server.port(), true);
    c.send(req);
    EXPECT_TRUE(closed_by_server(c.fd())) << name;
  }
  // Neither protocol: refused on its first byte.
  C10dClient stranger(server.port(), false);
  stranger.send(Req('G'));
  EXPECT_TRUE(closed_by_server(stranger.fd()));
  EXPECT_EQ(server.get_string("/keep"), "1");
}

double cpu_seconds(int who) {  // RUSAGE_SELF (the process) or RUSAGE_THREAD (this thread)
  rusage u{};
  getrusage(who, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// A 24 MiB MULTI_SET of 768 pairs trickles in, 64 KiB a millisecond, as a
// slow or hostile client sends it: the server scans each piece once and
// parses the request once it is all there (issue 30, item 6: it re-parsed
// the request from its first byte on every read, copying every pair
// received so far, which kept the server thread busy for the whole
// trickle; a 64 MiB request cost about 32 GiB of copies).
TEST(C10dStore, AMultiSetTricklingInIsScannedOnce) {
  auto server = make_server();
  C10dClient c(server->port(), true);
  constexpr int kPairs = 768;
  const std::string value(32 * 1024, 'v');
  Req r(kMultiSet);
  r.val<uint64_t>(kPairs);
  for (int i = 0; i < kPairs; ++i) r.str("/pair" + std::to_string(i)).str(value);
  const auto start = std::chrono::steady_clock::now();
  // The server's CPU: the process's less this (the client's) thread's,
  // whose sends into loopback cost 40-60 % of the trickle on some
  // machines and would hide what the server does.
  const double process_before = cpu_seconds(RUSAGE_SELF), client_before = cpu_seconds(RUSAGE_THREAD);
  for (size_t at = 0; at < r.b.size(); at += 64 * 1024) {
    const size_t n = std::min<size_t>(64 * 1024, r.b.size() - at);
    net::send_all(c.fd(), r.b.data() + at, n, net::Clock::now() + 10s, "server");
    std::this_thread::sleep_for(1ms);  // one read per piece
  }
  c.send(Req(kGet).str("/pair767"));
  EXPECT_EQ(c.recv_str(), value);  // answered after the whole MULTI_SET
  const double client = cpu_seconds(RUSAGE_THREAD) - client_before;
  const double cpu = cpu_seconds(RUSAGE_SELF) - process_before - client;
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start);
  std::cout << "a " << (r.b.size() >> 20) << " MiB MULTI_SET in 64 KiB pieces, one a millisecond: "
            << took.count() << " ms, " << int(cpu * 1000) << " ms of the server's CPU ("
            << int(client * 1000) << " ms the client's)" << std::endl;
  EXPECT_LT(took, 5s * kSlowdown);
  // Before the fix the server re-copied every pair received so far at each
  // read (4.6 GiB of copies for these 24 MiB): it could not keep up with
  // the trickle and was busy for nearly all of it. Now it copies each byte
  // in once; on a virtual machine whose page faults are slow, growing the
  // buffer still costs 42-49 % of the trickle (measured 2026-11-27: 214-226
  // ms of 511-521; perf: memmove and page faults), so the bound is 70 %.
  // Sanitizers alone keep a core busy.
  if (kSlowdown == 1)
    EXPECT_LT(cpu, 0.7 * 1e-3 * double(took.count())) << "the server was busy re-parsing";
  EXPECT_EQ(server->get_string("/pair0"), value);
}

// Requests are bounded as a whole, not only field by field, and refused as
// soon as a declared length passes the bound.
TEST(C10dStore, ARequestOverTheSizeLimitIsRefusedFromItsLengths) {
  auto server = make_server();
  C10dClient c(server->port(), true);
  Req r(kMultiSet);
  r.val<uint64_t>(2).str("/a").val<uint64_t>(40 << 20);  // 40 MiB declared, none sent
  c.send(r);
  EXPECT_FALSE(closed_by_server(c.fd()));  // fine so far: waits for the value
  C10dClient d(server->port(), true);
  Req big(kMultiSet);
  big.val<uint64_t>(2).str("/a").str(std::string(1 << 20, 'x')).str("/b").val<uint64_t>(64 << 20);
  d.send(big);  // 1 MiB then a declared 64 MiB: over the request limit
  EXPECT_TRUE(closed_by_server(d.fd()));
  EXPECT_FALSE(server->check({"/a"}));
}

}  // namespace
}  // namespace dtrain
