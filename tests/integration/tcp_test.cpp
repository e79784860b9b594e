// The tcp backend and its transport: the "gloo" alias, messages that arrive
// before their receive, mismatched sizes, fail-fast after a failure, and a
// hostile or dying peer speaking the wire protocol by hand.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <optional>
#include <thread>

#include "common/socket.h"
#include "harness/assertions.h"
#include "harness/scoped_env.h"
#include "harness/thread_ranks.h"
#include "transport/engine/connection.h"
#include "transport/tcp/hello.h"
#include "transport/fabric.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::expect_no_errors;
using testing::run_ranks;
using testing::what_thrown;

TEST(TcpBackend, GlooIsAnAliasOfTcp) {
  expect_no_errors(run_ranks(2, [](ProcessGroup& g) {
    EXPECT_EQ(g.backend_name(), "tcp");
    auto t = at::full({3}, g.rank() + 1, at::kInt);
    g.all_reduce(t)->wait();
    EXPECT_TRUE(at::equal(t, at::full({3}, 3, at::kInt)));
  }, 30s, GroupOptions(), "gloo"));
}

TEST(TcpBackend, SendBeforeReceiveIsPostedIsHeldAndDelivered) {
  // 3 MiB: split over the streams, and it arrives long before the receive.
  expect_no_errors(run_ranks(2, [](ProcessGroup& g) {
    const int64_t n = 3 << 18;
    if (g.rank() == 0) {
      g.send(at::arange(n, at::kFloat), 1, 5)->wait();
      g.send(at::full({7}, 9.0f), 1, 6)->wait();
    } else {
      std::this_thread::sleep_for(300ms);
      auto small = at::zeros({7});
      auto big = at::zeros({n});
      g.recv(small, 0, 6)->wait();  // other tag first: messages never block each other
      g.recv(big, 0, 5)->wait();
      EXPECT_TRUE(at::equal(big, at::arange(n, at::kFloat)));
      EXPECT_TRUE(at::equal(small, at::full({7}, 9.0f)));
    }
  }));
}

TEST(TcpBackend, MismatchedSizesFailNamingThePeerAndBothSizes) {
  auto errors = run_ranks(2, [](ProcessGroup& g) {
    auto t = at::zeros({g.rank() == 0 ? 10 : 20});
    if (g.rank() == 0) g.recv(t, 1)->wait(); else g.send(t, 0)->wait();
  }, 10s);
  EXPECT_NE(errors[0].find("rank 1"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("sent 80 bytes where this rank expected 40"), std::string::npos)
      << errors[0];
}

TEST(TcpBackend, AfterATimeoutTheNextCallFailsAtOnceNamingTheFirstError) {
  std::atomic<bool> rank0_done{false};
  auto errors = run_ranks(2, [&](ProcessGroup& g) {
    if (g.rank() == 1) {  // silent until rank 0 has given up
      while (!rank0_done) std::this_thread::sleep_for(10ms);
      return;
    }
    auto t = at::ones({4});
    auto first = what_thrown<TimeoutError>([&] { g.all_reduce(t, ReduceOp::SUM, 300ms)->wait(); });
    EXPECT_NE(first.find("timed out waiting for rank 1"), std::string::npos) << first;
    const auto start = std::chrono::steady_clock::now();
    auto second = what_thrown<NetworkError>([&] { g.all_reduce(t, ReduceOp::SUM, 20s)->wait(); });
    EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
    EXPECT_NE(second.find("broken by an earlier error"), std::string::npos) << second;
    EXPECT_NE(second.find("timed out"), std::string::npos) << second;
    rank0_done = true;
  }, 30s);
  EXPECT_EQ(errors[0], "");
}

// Rank 1 of a two-rank transport, played by hand over raw sockets.
class FakePeer {
 public:
  FakePeer(Store& store, int streams, uint32_t eager_kib = 64) {
    const auto id = std::stoull(store.get_string("tcp/id"));
    const auto addr = store.get_string("tcp/addr/0");
    const auto nl = addr.find('\n');
    const auto port = static_cast<uint16_t>(std::stoi(addr.substr(nl + 1)));
    for (int s = 0; s < streams; ++s) {
      auto fd = net::connect_to(addr.substr(0, nl), port, net::Clock::now() + 10s);
      const transport::tcp::Hello hello{transport::tcp::kHelloMagic,
                                        transport::tcp::kHelloVersion, id, 1,
                                        static_cast<uint32_t>(s), 0, eager_kib, {}};
      net::send_all(fd.get(), &hello, sizeof(hello), net::Clock::now() + 10s, "rank 0");
      transport::tcp::Hello reply{};
      net::recv_all(fd.get(), &reply, sizeof(reply), net::Clock::now() + 10s, "rank 0");
      fds.push_back(std::move(fd));
    }
  }
  void send(const void* data, size_t n) {
    net::send_all(fds[0].get(), data, n, net::Clock::now() + 10s, "rank 0");
  }
  std::vector<net::Fd> fds;
};

// Rank 0's real transport (2 streams) connected to the fake rank 1.
struct RealAndFake {
  explicit RealAndFake(size_t unexpected_bytes, size_t unexpected_messages = 65536) : store(10s) {
    transport::TcpOptions options;
    options.unexpected_bytes = unexpected_bytes;
    options.unexpected_messages = unexpected_messages;
    options.streams = 2;
    options.timeout = 10s;
    options.name = "hostile";
    std::thread real([&] {
      t = transport::connect(store, 0, transport::Topology::host_per_rank(2),
                             transport::FabricOptions{options})
              .transport;
    });
    fake.emplace(store, options.streams);
    real.join();
  }
  HashStore store;
  std::unique_ptr<transport::Transport> t;
  std::optional<FakePeer> fake;
};

// Rank 0's real transport against the fake rank 1; returns what rank 0's
// receive of 100 bytes throws.
std::string receive_from_fake(const std::function<void(FakePeer&)>& act,
                              bool breaks = true, size_t unexpected_bytes = size_t{64} << 20,
                              size_t unexpected_messages = 65536) {
  RealAndFake ends(unexpected_bytes, unexpected_messages);
  auto& t = ends.t;
  auto& fake = *ends.fake;
  std::vector<uint8_t> buf(100);
  auto request = t->irecv(1, 42, buf.data(), buf.size());
  act(fake);
  std::string what;
  try {
    request->wait(transport::Clock::now() + 10s, "recv");
  } catch (const NetworkError& e) {
    what = e.what();
  }
  // The group is broken for good; the transport still shuts down cleanly.
  if (breaks) EXPECT_THROW(t->isend(1, 43, buf.data(), 1), NetworkError);
  return what;
}

TEST(TcpTransport, GarbageFromAPeerFailsTheGroupNamingThePeer) {
  auto what = receive_from_fake([](FakePeer& p) {
    const char garbage[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    p.send(garbage, sizeof(garbage));
  });
  EXPECT_NE(what.find("rank 1"), std::string::npos) << what;
  EXPECT_NE(what.find("not a dtrain frame"), std::string::npos) << what;
}

TEST(TcpTransport, APeerThatClosesMidMessageFailsTheGroupNamingThePeer) {
  auto what = receive_from_fake([](FakePeer& p) {
    const uint64_t header[3] = {0x6d465464, 42, 100};  // magic + kind (kData), tag, total
    p.send(header, sizeof(header));
    const uint8_t half[50] = {};
    p.send(half, sizeof(half));
    p.fds.clear();  // closes every stream
  });
  EXPECT_NE(what.find("rank 1"), std::string::npos) << what;
  EXPECT_NE(what.find("closed the connection"), std::string::npos) << what;
}

// Before flow control, the receiver allocated whatever a header declared
// (here 512 GiB on its I/O thread: std::terminate). Now a payload over the
// credit it granted (64 KiB here, from the hello) is refused unread.
TEST(TcpTransport, APeerThatSendsMoreThanItsCreditFailsTheGroupWithoutAllocating) {
  auto what = receive_from_fake([](FakePeer& p) {
    const uint64_t header[3] = {0x6d465464, 7, uint64_t{1} << 40};  // kData, tag 7, 1 TiB
    p.send(header, sizeof(header));
  });
  EXPECT_TRUE(testing::Contains(what, "rank 1")) << what;
  EXPECT_TRUE(testing::Contains(what, "bytes ahead of its receives, over the")) << what;
}

// Empty messages cost the credit (256 bytes each), announcements a count
// of their own: a peer that streams either for a tag nobody receives fails
// the group once it passes the 64 KiB it was granted (256 empty messages),
// or the 1,024 announcements this rank holds, instead of making the
// receiver hold an entry for each of the 2,000 it sends.
TEST(TcpTransport, APeerThatStreamsAnnouncementsOrEmptyMessagesIsHeldToItsBounds) {
  for (const uint64_t kind : {uint64_t{1}, uint64_t{0}}) {  // kRts, then zero-byte kData
    auto what = receive_from_fake(
        [&](FakePeer& p) {
          std::vector<uint64_t> frames;
          for (int i = 0; i < 2000; ++i)
            frames.insert(frames.end(), {transport::engine::kFrameMagic | (kind << 32), 9,
                                         kind == 1 ? uint64_t{300000} : uint64_t{0}});
          try {
            p.send(frames.data(), frames.size() * sizeof(uint64_t));
          } catch (const std::exception&) {  // rank 0 may close before reading it all
          }
        },
        /*breaks=*/true, /*unexpected_bytes=*/128 << 10, /*unexpected_messages=*/1024);
    EXPECT_TRUE(testing::Contains(what, kind == 1 ? "announced more messages ahead of their "
                                                    "receives than the 1024 this rank holds"
                                                  : "sent messages costing 65792 bytes ahead of "
                                                    "its receives, over the 65536 bytes"))
        << what;
  }
}

TEST(TcpTransport, APeerThatAsksForAnUnannouncedMessageFailsTheGroup) {
  auto what = receive_from_fake([](FakePeer& p) {
    const uint64_t header[3] = {0x6d465464 | (uint64_t{2} << 32), 0, 0};  // kCts, id 0
    p.send(header, sizeof(header));
  });
  EXPECT_TRUE(testing::Contains(what, "asked for a message this rank never announced")) << what;
}

TEST(TcpTransport, APeerThatSendsAnUnaskedPayloadFailsTheGroup) {
  auto what = receive_from_fake([](FakePeer& p) {
    const uint64_t header[3] = {0x6d465464 | (uint64_t{3} << 32), 5, 100};  // kRndvData
    p.send(header, sizeof(header));
  });
  EXPECT_TRUE(testing::Contains(what, "sent a payload this rank did not ask for")) << what;
}

// Issue 42 item 6. An any-source receive binds to the peer whose message of
// its tag arrives first on stream 0; its parts on that peer's other streams
// are posted once that read is done. When the same frame breaks the
// connection (here: its size is not the receive's), the receive has failed
// by then, and what the peer had already sent on stream 1 (held, waiting
// for its receive) must not be copied into the failed receive's buffer.
// Before the fix it was: the second half of the buffer changed after the
// receive had failed.
TEST(TcpTransport, AnAnySourceReceiveThatFailsAsItMatchesTakesNoHeldPayload) {
  RealAndFake ends(size_t{64} << 20);
  auto& t = ends.t;
  auto& fake = *ends.fake;
  constexpr size_t kTotal = 512 << 10;  // over kSplitBytes: half on each stream
  constexpr size_t kHalf = kTotal / 2;
  std::vector<uint8_t> any(kTotal, 0xAA), probe_buffer(kTotal);
  auto receive = t->irecv_any(7, any.data(), any.size());
  auto probe = t->irecv(1, 8, probe_buffer.data(), probe_buffer.size());
  auto send_frame = [&](int stream, uint64_t tag, uint64_t total, size_t payload_bytes) {
    const uint64_t header[3] = {transport::engine::kFrameMagic, tag, total};  // kData
    const std::vector<uint8_t> payload(payload_bytes, 0x55);
    const auto deadline = net::Clock::now() + 10s;
    net::send_all(fake.fds[stream].get(), header, sizeof(header), deadline, "rank 0");
    net::send_all(fake.fds[stream].get(), payload.data(), payload.size(), deadline, "rank 0");
  };
  // Stream 1 first carries tag 7's second half (held: nothing of rank 1's
  // claims it yet), then tag 8's; once tag 8 is complete, rank 0 has read
  // past tag 7's half and holds it.
  send_frame(1, 7, kTotal, kHalf);
  send_frame(0, 8, kTotal, kHalf);
  send_frame(1, 8, kTotal, kHalf);
  probe->wait(transport::Clock::now() + 10s, "probe");
  // Tag 7 on stream 0, claiming twice the receive's size: matched, split,
  // and failed in one read.
  send_frame(0, 7, 2 * kTotal, 0);
  std::string what;
  try {
    receive->wait(transport::Clock::now() + 10s, "irecv_any");
  } catch (const std::exception& e) {
    what = e.what();
  }
  EXPECT_TRUE(testing::Contains(what, "rank 1")) << what;
  t.reset();  // the I/O threads are done with the buffer
  const auto changed = std::count_if(any.begin(), any.end(), [](uint8_t b) { return b != 0xAA; });
  EXPECT_EQ(changed, 0) << "bytes of the failed receive's buffer were written";
}

TEST(TcpTransport, AnAnnouncedMessageIsFetchedOnlyOnceItsReceiveIsPosted) {
  auto what = receive_from_fake([](FakePeer& p) {
    // A kRts for tag 42 (rank 0's posted receive of 100 bytes): rank 0
    // answers kCts for rendezvous 0; the payload follows as kRndvData.
    const uint64_t rts[3] = {0x6d465464 | (uint64_t{1} << 32), 42, 100};
    p.send(rts, sizeof(rts));
    uint64_t cts[3] = {};
    net::recv_all(p.fds[0].get(), cts, sizeof(cts), net::Clock::now() + 10s, "rank 0");
    EXPECT_EQ(cts[0], 0x6d465464 | (uint64_t{2} << 32));
    EXPECT_EQ(cts[1], 0u);
    const uint64_t data[3] = {0x6d465464 | (uint64_t{3} << 32), 0, 100};
    p.send(data, sizeof(data));
    const uint8_t payload[100] = {};
    p.send(payload, sizeof(payload));
  }, /*breaks=*/false);
  EXPECT_EQ(what, "");
}

// A send completes once the kernel holds its bytes, not once they arrived.
// A rank that leaves right after must close in order: had it closed with a
// frame from its peer unread, or had a frame come after its close, the
// kernel would reset the connection and drop the bytes it had not passed on
// yet (CI saw "Connection reset by peer", now and then). `send_and_leave`
// plays rank 0: it sends 1 MiB to the fake rank 1, then leaves.
void expect_delivered_after_leaving(
    const std::function<void(Store&, std::function<void()>& leave)>& send_and_leave) {
  HashStore store(10s);
  std::function<void()> leave;
  std::thread real([&] { send_and_leave(store, leave); });
  FakePeer fake(store, 1, /*eager_kib=*/4096);  // 1 MiB goes eager
  real.join();
  // The fake has read nothing yet: most of the message is in rank 0's kernel.
  std::thread leaving(leave);
  std::this_thread::sleep_for(200ms);
  // The credit for those bytes comes back late, then the fake's FIN, as a
  // real rank sends it once it has seen rank 0's.
  const uint64_t credit[3] = {transport::engine::kFrameMagic | (uint64_t{4} << 32), 0, 1 << 20};
  fake.send(credit, sizeof(credit));
  ::shutdown(fake.fds[0].get(), SHUT_WR);
  std::vector<uint8_t> in(64 << 10);
  size_t got = 0;
  ssize_t n;
  while ((n = ::recv(fake.fds[0].get(), in.data(), in.size(), 0)) > 0) got += static_cast<size_t>(n);
  EXPECT_EQ(n, 0) << "rank 0's connection ended with " << strerror(errno) << " after " << got
                  << " bytes";
  EXPECT_EQ(got, sizeof(transport::engine::FrameHeader) + (1 << 20));
  leaving.join();
}

TEST(TcpTransport, ATransportDestroyedRightAfterASendStillDeliversIt) {
  std::unique_ptr<transport::Transport> t;
  std::vector<uint8_t> out(1 << 20, 7);
  expect_delivered_after_leaving([&](Store& store, std::function<void()>& leave) {
    transport::TcpOptions options;
    options.streams = 1;
    options.timeout = 10s;
    options.name = "leaving";
    t = transport::connect(store, 0, transport::Topology::host_per_rank(2),
                           transport::FabricOptions{options})
            .transport;
    t->isend(1, 5, out.data(), out.size())->wait(transport::Clock::now() + 10s, "send");
    leave = [&] { t.reset(); };
  });
}

TEST(TcpBackend, AGroupDestroyedRightAfterASendStillDeliversIt) {
  testing::ScopedEnv streams("DTRAIN_TCP_STREAMS", "1");
  std::shared_ptr<ProcessGroup> g;
  expect_delivered_after_leaving([&](Store& store, std::function<void()>& leave) {
    std::shared_ptr<Store> borrowed(&store, [](Store*) {});
    g = create_process_group("tcp", borrowed, 0, 2, GroupOptions().timeout(10s));
    g->send(at::full({1 << 18}, 7.0f), 1, 5)->wait();
    leave = [&] { g.reset(); };
  });
}

TEST(TcpTransport, AStrangerWithABadHelloIsTurnedAwayAndTheGroupStillForms) {
  HashStore store(10s);
  transport::TcpOptions options;
  options.streams = 1;
  options.timeout = 10s;
  std::unique_ptr<transport::Transport> t0, t1;
  std::thread real([&] {
    t0 = transport::connect(store, 0, transport::Topology::host_per_rank(2),
                            transport::FabricOptions{options})
             .transport;
  });
  {
    const auto addr = store.get_string("tcp/addr/0");
    const auto nl = addr.find('\n');
    auto fd = net::connect_to(addr.substr(0, nl),
                              static_cast<uint16_t>(std::stoi(addr.substr(nl + 1))),
                              net::Clock::now() + 10s);
    const char junk[24] = "definitely not a hello";
    net::send_all(fd.get(), junk, sizeof(junk), net::Clock::now() + 10s, "rank 0");
    t1 = transport::connect(store, 1, transport::Topology::host_per_rank(2),
                            transport::FabricOptions{options})
             .transport;
  }
  real.join();
  int32_t out = 7, in = 0;
  auto r = t0->irecv(1, 1, &in, sizeof(in));
  t1->isend(0, 1, &out, sizeof(out))->wait(transport::Clock::now() + 10s, "send");
  r->wait(transport::Clock::now() + 10s, "recv");
  EXPECT_EQ(in, 7);
}

// The group id rank 0 publishes comes from the store, which other programs
// may write to: one that is not a number fails the other ranks naming it
// (it failed as std::stoull's bare "stoull", or took a sign as a number).
TEST(TcpTransport, AMalformedGroupIdInTheStoreFailsNamingIt) {
  for (const std::string bad : {"bogus", "-1", " 7", "18446744073709551616", ""}) {
    HashStore store(10s);
    store.set("tcp/id", bad);
    transport::TcpOptions options;
    options.streams = 1;
    options.timeout = 10s;
    const auto what = what_thrown<InvalidArgument>([&] {
      transport::connect(store, 1, transport::Topology::host_per_rank(2), transport::FabricOptions{options});
    });
    EXPECT_TRUE(testing::Contains(what, "tcp: the store holds a malformed group id: '" + bad + "'"));
  }
}

// A group over two hosts (backend auto) joins ranks across hosts by TCP and
// ranks of one host by rings: a connection that claims to come from a rank
// of the acceptor's own host is refused (it cannot be that rank), and the
// group still forms, rings and sockets both carrying messages.
TEST(TcpTransport, AConnectionClaimingARankOfTheSameHostIsRefused) {
  HashStore store(10s);
  transport::TcpOptions options;
  options.streams = 1;
  options.timeout = 10s;
  options.name = "hosts";
  const transport::Topology topology({{0, 2}, {1}});  // 2 shares rank 0's host
  std::vector<std::unique_ptr<transport::Transport>> t(3);
  std::vector<std::thread> ranks;
  auto start = [&](int r) {
    ranks.emplace_back([&, r] {
      t[r] = transport::connect(store, r, topology, transport::FabricOptions{options, false, "auto"})
                 .transport;
    });
  };
  start(0);
  start(2);  // rank 1 only once the stranger is answered: rank 0 still listens
  transport::tcp::Hello reply{};
  try {
    const auto addr = store.get_string("tcp/addr/0");
    const auto nl = addr.find('\n');
    auto fd = net::connect_to(addr.substr(0, nl),
                              static_cast<uint16_t>(std::stoi(addr.substr(nl + 1))),
                              net::Clock::now() + 10s);
    const transport::tcp::Hello hello{transport::tcp::kHelloMagic, transport::tcp::kHelloVersion,
                                      std::stoull(store.get_string("tcp/id")), 2, 0, 0, 64, {}};
    net::send_all(fd.get(), &hello, sizeof(hello), net::Clock::now() + 10s, "rank 0");
    net::recv_all(fd.get(), &reply, sizeof(reply), net::Clock::now() + 10s, "rank 0");
  } catch (const std::exception& e) {
    ADD_FAILURE() << "the stranger: " << e.what();
  }
  start(1);
  for (auto& r : ranks) r.join();
  EXPECT_EQ(reply.flags, transport::tcp::kHelloRefused);
  EXPECT_EQ(reply.eager_kib, static_cast<uint32_t>(transport::tcp::Refusal::kOutOfRange));
  int32_t from_ring = 0, from_tcp = 0, two = 2, one = 1;
  auto a = t[0]->irecv(2, 1, &from_ring, sizeof(from_ring));
  auto b = t[0]->irecv(1, 1, &from_tcp, sizeof(from_tcp));
  t[2]->isend(0, 1, &two, sizeof(two))->wait(transport::Clock::now() + 10s, "send");
  t[1]->isend(0, 1, &one, sizeof(one))->wait(transport::Clock::now() + 10s, "send");
  a->wait(transport::Clock::now() + 10s, "recv");
  b->wait(transport::Clock::now() + 10s, "recv");
  EXPECT_EQ(from_ring, 2);
  EXPECT_EQ(from_tcp, 1);
}

}  // namespace
}  // namespace dtrain
