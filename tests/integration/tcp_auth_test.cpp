// The TCP transport's connections under a job token (DTRAIN_STORE_TOKEN):
// both ends prove they hold it before a byte of data moves. A stranger
// with a well-formed hello but no token is turned away while the group
// forms; ranks with different tokens, or with and without one, fail with
// an error that says so instead of exchanging data.

#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "common/socket.h"
#include "dtrain/errors.h"
#include "dtrain/store/hash_store.h"
#include "harness/assertions.h"
#include "transport/tcp/hello.h"
#include "transport/fabric.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::Contains;
using testing::what_thrown;
namespace tcp = transport::tcp;

transport::TcpOptions options_with(const std::string& token, std::chrono::milliseconds timeout) {
  transport::TcpOptions o;
  o.streams = 2;
  o.timeout = timeout;
  o.name = "auth";
  o.token = token;
  return o;
}

// Rank 0 and rank 1 of a two-rank transport, each with its own options;
// rank 1 starts once rank 0 listens.
struct Pair {
  std::unique_ptr<transport::Transport> t0, t1;
  std::string error0, error1;
};

Pair connect_pair(HashStore& store, const transport::TcpOptions& o0,
                  const transport::TcpOptions& o1,
                  const std::function<void()>& before_rank1 = [] {}) {
  Pair p;
  std::thread rank0([&] {
    try {
      p.t0 = transport::connect(store, 0, transport::Topology::host_per_rank(2),
                                transport::FabricOptions{o0})
                 .transport;
    } catch (const std::exception& e) {
      p.error0 = e.what();
    }
  });
  (void)store.get_string("tcp/addr/0");  // rank 0 listens
  before_rank1();
  try {
    p.t1 = transport::connect(store, 1, transport::Topology::host_per_rank(2),
                              transport::FabricOptions{o1})
               .transport;
  } catch (const std::exception& e) {
    p.error1 = e.what();
  }
  rank0.join();
  return p;
}

void expect_exchange(Pair& p) {
  ASSERT_TRUE(p.t0 && p.t1) << p.error0 << " | " << p.error1;
  std::vector<int32_t> out(100000, 7), in(100000, 0);  // split over both streams
  auto r = p.t0->irecv(1, 5, in.data(), in.size() * 4);
  p.t1->isend(0, 5, out.data(), out.size() * 4)->wait(transport::Clock::now() + 10s, "send");
  r->wait(transport::Clock::now() + 10s, "recv");
  EXPECT_EQ(in, out);
}

TEST(TcpAuth, RanksWithTheSameTokenFormTheGroup) {
  HashStore store(10s);
  auto p = connect_pair(store, options_with("s3cret", 10s), options_with("s3cret", 10s));
  expect_exchange(p);
}

// A stranger claims rank 1's first stream with a perfect hello and a
// random "proof": rank 0 answers it (its proof tells the stranger
// nothing), refuses the proof, and takes the real rank 1.
TEST(TcpAuth, AStrangerWithoutTheTokenIsTurnedAwayAndTheGroupForms) {
  HashStore store(10s);
  net::Fd stranger;
  auto p = connect_pair(store, options_with("s3cret", 10s), options_with("s3cret", 10s), [&] {
    const auto addr = store.get_string("tcp/addr/0");
    const auto nl = addr.find('\n');
    stranger = net::connect_to(addr.substr(0, nl),
                               static_cast<uint16_t>(std::stoi(addr.substr(nl + 1))),
                               net::Clock::now() + 10s);
    const tcp::Hello h{tcp::kHelloMagic, tcp::kHelloVersion, std::stoull(store.get_string("tcp/id")),
                       1, 0, tcp::kHelloHasToken, /*eager_kib=*/64, store_auth::random_nonce()};
    net::send_all(stranger.get(), &h, sizeof(h), net::Clock::now() + 10s, "rank 0");
    tcp::Hello reply{};
    net::recv_all(stranger.get(), &reply, sizeof(reply), net::Clock::now() + 10s, "rank 0");
    EXPECT_EQ(reply.rank, 0u);
    store_auth::Proof proof{}, guess{};
    net::recv_all(stranger.get(), proof.data(), proof.size(), net::Clock::now() + 10s, "rank 0");
    guess.fill(0x5a);
    net::send_all(stranger.get(), guess.data(), guess.size(), net::Clock::now() + 10s, "rank 0");
  });
  expect_exchange(p);
  // Rank 0 closed the stranger's connection.
  char byte;
  EXPECT_EQ(::recv(stranger.get(), &byte, 1, 0), 0);
}

TEST(TcpAuth, DifferentTokensFailWithoutExchangingData) {
  HashStore store(10s);
  auto p = connect_pair(store, options_with("one", 3s), options_with("two", 3s));
  EXPECT_FALSE(p.t0);
  EXPECT_FALSE(p.t1);
  EXPECT_TRUE(Contains(p.error1, "does not hold this job's token (is DTRAIN_STORE_TOKEN the same "
                                 "on every rank?)"))
      << p.error1;
  EXPECT_TRUE(Contains(p.error0, "ranks 1 did not connect within 3000 ms")) << p.error0;
}

TEST(TcpAuth, ARankWithoutTheTokenIsRefusedWithAHint) {
  HashStore store(10s);
  auto p = connect_pair(store, options_with("s3cret", 3s), options_with("", 3s));
  EXPECT_FALSE(p.t1);
  // Rank 0 tells it why (a refusal hello) before closing.
  EXPECT_TRUE(Contains(p.error1, "rank 0 (127.0.0.1:")) << p.error1;
  EXPECT_TRUE(Contains(p.error1, "refused this rank's connection: it uses a job token and this "
                                 "rank has none (is DTRAIN_STORE_TOKEN set on every rank?)"))
      << p.error1;
  HashStore other(10s);
  auto q = connect_pair(other, options_with("", 3s), options_with("s3cret", 3s));
  EXPECT_FALSE(q.t1);
  EXPECT_TRUE(Contains(q.error1, "refused this rank's connection: this rank uses a job token and "
                                 "it has none (is DTRAIN_STORE_TOKEN set on every rank?)"))
      << q.error1;
}

}  // namespace
}  // namespace dtrain
