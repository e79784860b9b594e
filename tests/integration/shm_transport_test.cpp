// The shm transport (transport/shm/): the tcp transport's engine over byte
// rings in shared memory. Messages of every size, across ring wraps, by
// eager credit and by rendezvous; order; an orderly close that loses
// nothing; and the shm backend's send/recv opening no socket.

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <thread>

#include "dtrain/dtrain.h"
#include "harness/assertions.h"
#include "harness/scoped_env.h"
#include "harness/thread_ranks.h"
#include "transport/fabric.h"
#include "transport/shm/links.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::Contains;
using testing::expect_no_errors;
using transport::Clock;

// Runs `body` on `world` threads, each with its rank's shm transport.
std::vector<std::string> run_transports(
    int world, size_t unexpected_bytes,
    const std::function<void(transport::Transport&, int rank)>& body) {
  HashStore store(20s);
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        transport::FabricOptions options;
        options.tcp.timeout = 20s;
        options.tcp.name = "rings";
        options.tcp.unexpected_bytes = unexpected_bytes;
        options.label = "shm";
        auto t = transport::connect(store, r, transport::Topology::one_host(world), options)
                     .transport;
        body(*t, r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

uint8_t pattern(int from, int to, size_t size, size_t i) {
  return static_cast<uint8_t>(from * 31 + to * 7 + size + i * 13);
}

TEST(ShmTransport, EverySizeArrivesExactByCreditAndByRendezvousAcrossRingWraps) {
  const std::vector<size_t> sizes = {0, 1, 63, 4097, (1 << 20) + 13, (5 << 20) + 1};
  EXPECT_EQ(shm::ring_bytes(3), size_t{1} << 20);  // so 5 MiB wraps five times
  // A 64 KiB budget: the small sizes go eager, the large by rendezvous.
  expect_no_errors(run_transports(3, 64 << 10, [&](transport::Transport& t, int me) {
    std::vector<std::vector<uint8_t>> out, in;
    std::vector<transport::RequestPtr> sends, recvs;
    for (int peer = 0; peer < 3; ++peer) {
      if (peer == me) continue;
      for (size_t k = 0; k < sizes.size(); ++k) {
        out.emplace_back(sizes[k]);
        for (size_t i = 0; i < sizes[k]; ++i) out.back()[i] = pattern(me, peer, sizes[k], i);
        sends.push_back(t.isend(peer, k, out.back().data(), sizes[k]));
      }
    }
    std::this_thread::sleep_for(20ms);  // most messages arrive before their receive
    std::vector<std::pair<int, size_t>> from;
    for (int peer = 0; peer < 3; ++peer) {
      if (peer == me) continue;
      for (size_t k = sizes.size(); k-- > 0;) {  // the other tag order
        in.emplace_back(sizes[k]);
        from.emplace_back(peer, sizes[k]);
        recvs.push_back(t.irecv(peer, k, in.back().data(), sizes[k]));
      }
    }
    for (auto& r : recvs) r->wait(Clock::now() + 20s, "recv");
    for (auto& s : sends) s->wait(Clock::now() + 20s, "send");
    for (size_t m = 0; m < in.size(); ++m) {
      const auto [peer, size] = from[m];
      size_t wrong = 0;
      for (size_t i = 0; i < size; ++i) wrong += in[m][i] != pattern(peer, me, size, i);
      EXPECT_EQ(wrong, 0u) << size << " bytes from rank " << peer;
    }
  }));
}

TEST(ShmTransport, MessagesOfOneTagArriveInPostingOrder) {
  expect_no_errors(run_transports(2, 64 << 20, [&](transport::Transport& t, int me) {
    std::vector<int32_t> values(200);
    std::vector<transport::RequestPtr> requests;
    for (int i = 0; i < 200; ++i) {
      values[i] = me == 0 ? i : -1;
      requests.push_back(me == 0 ? t.isend(1, 9, &values[i], 4) : t.irecv(0, 9, &values[i], 4));
    }
    for (auto& r : requests) r->wait(Clock::now() + 20s, "p2p");
    for (int i = 0; i < 200; ++i) EXPECT_EQ(values[i], i);
  }));
}

// A send completes once the ring holds its bytes; a transport closed right
// after must still deliver them, and then the peer reads its end. Its close
// also stops it reading: the credit the receiver gives back for the last
// bytes must not cost them (that once failed the receive with "sending to
// rank 1 ... failed: Broken pipe", now and then). Returns what rank 0's
// next receive threw.
std::string receive_from_a_closed_sender() {
  std::atomic<bool> sent{false};
  std::string after;
  expect_no_errors(run_transports(2, 64 << 20, [&](transport::Transport& t, int me) {
    std::vector<uint8_t> buf(3 << 20);  // eager, three times the ring
    if (me == 1) {
      for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 7);
      t.isend(0, 1, buf.data(), buf.size())->wait(Clock::now() + 20s, "send");
      t.close(std::make_exception_ptr(NetworkError("closed")));
      sent = true;
      return;
    }
    while (!sent) std::this_thread::sleep_for(1ms);
    t.irecv(1, 1, buf.data(), buf.size())->wait(Clock::now() + 20s, "recv");
    size_t wrong = 0;
    for (size_t i = 0; i < buf.size(); ++i) wrong += buf[i] != static_cast<uint8_t>(i * 7);
    EXPECT_EQ(wrong, 0u);
    const auto start = Clock::now();
    try {
      t.irecv(1, 2, buf.data(), 1)->wait(Clock::now() + 20s, "recv");
    } catch (const NetworkError& e) {
      after = e.what();
    }
    EXPECT_LT(Clock::now() - start, 2s);
  }));
  return after;
}

TEST(ShmTransport, ATransportClosedRightAfterItsSendsStillDeliversThem) {
  for (int round = 0; round < 10; ++round) {
    const auto after = receive_from_a_closed_sender();
    EXPECT_TRUE(Contains(after, "shm: rank 1 (pid ")) << after;
    EXPECT_TRUE(Contains(after, "closed the connection")) << "round " << round << ": " << after;
  }
}

int open_sockets() {
  int n = 0;
  DIR* dir = opendir("/proc/self/fd");
  while (dirent* e = readdir(dir)) {
    struct stat st {};
    if (fstatat(dirfd(dir), e->d_name, &st, 0) == 0 && S_ISSOCK(st.st_mode)) ++n;
  }
  closedir(dir);
  return n;
}

TEST(ShmTransport, TheShmBackendsSendAndRecvOpenNoSocket) {
  const int before = open_sockets();
  std::atomic<int> during{-1};
  expect_no_errors(testing::run_ranks(3, [&](ProcessGroup& g) {
    const int next = (g.rank() + 1) % 3, prev = (g.rank() + 2) % 3;
    auto in = at::zeros({1000});
    auto r = g.recv(in, prev);
    g.send(at::full({1000}, float(g.rank())), next)->wait();
    r->wait();
    EXPECT_TRUE(at::equal(in, at::full({1000}, float(prev))));
    g.barrier()->wait();
    if (g.rank() == 0) during = open_sockets();
    g.barrier()->wait();
  }, 20s, GroupOptions(), "shm"));
  EXPECT_EQ(during.load(), before);  // the thread ranks' store is in memory
}

// Backend auto over two stand-in hosts of two ranks each (thread_ranks.h):
// one group, whose pairs inside a host are rings and whose pairs across
// hosts are TCP. 4 such pairs with DTRAIN_TCP_STREAMS sockets each, both
// ends in this process; a full mesh (the nested groups before) holds more.
TEST(ShmTransport, AutoOverTwoHostsOpensSocketsOnlyAcrossThem) {
  testing::ScopedEnv streams("DTRAIN_TCP_STREAMS", "2");
  // auto asks CUDA how many GPUs there are; on a GPU machine the driver's
  // first use opens a socket of its own (one more, on an H200): count from
  // after it.
  if (at::globalContext().hasCUDA()) at::detail::getCUDAHooks().getNumGPUs();
  const int before = open_sockets();
  std::atomic<int> during{-1};
  expect_no_errors(testing::run_ranks(4, [&](ProcessGroup& g) {
    // (followed by how CUDA tensors go, where libtorch has CUDA)
    EXPECT_EQ(g.backend_name().rfind("auto (shm within 2 machines, tcp between)", 0), 0u)
        << g.backend_name();
    const int next = (g.rank() + 1) % 4, prev = (g.rank() + 3) % 4;
    auto in = at::zeros({100000});
    auto r = g.recv(in, prev);
    g.send(at::full({100000}, float(g.rank())), next)->wait();
    r->wait();
    EXPECT_TRUE(at::equal(in, at::full({100000}, float(prev))));
    auto sum = at::full({300000}, float(g.rank() + 1));
    g.all_reduce(sum)->wait();  // two-level: rings, then TCP, then rings
    EXPECT_TRUE(at::equal(sum, at::full({300000}, 10.f)));
    g.barrier()->wait();
    if (g.rank() == 0) during = open_sockets();
    g.barrier()->wait();
  }, 20s, GroupOptions(), "auto@2"));
  EXPECT_EQ(during.load() - before, 4 * 2 * 2);
}

int threads_of_this_process() {
  int n = 0;
  DIR* dir = opendir("/proc/self/task");
  while (dirent* e = readdir(dir)) n += e->d_name[0] != '.';
  closedir(dir);
  return n;
}

// Each rank of auto over two stand-in hosts runs 4 threads of dtrain's at
// one or two TCP streams: the collectives, the send/recv completion, the
// rings' I/O and one TCP I/O thread (which serves every stream while the
// rings have a thread of their own). Before, two streams took 5.
TEST(ShmTransport, AutoOverTwoHostsRunsFourThreadsPerRankAtAnyStreamCount) {
  for (const char* streams : {"1", "2"}) {
    testing::ScopedEnv forced("DTRAIN_TCP_STREAMS", streams);
    const int before = threads_of_this_process();
    std::atomic<int> during{-1};
    expect_no_errors(testing::run_ranks(4, [&](ProcessGroup& g) {
      auto in = at::zeros({4});
      auto r = g.recv(in, (g.rank() + 3) % 4);
      g.send(at::full({4}, float(g.rank())), (g.rank() + 1) % 4)->wait();
      r->wait();
      g.barrier()->wait();
      if (g.rank() == 0) during = threads_of_this_process();
      g.barrier()->wait();
    }, 20s, GroupOptions(), "auto@2"));
    // The 4 ranks' own threads (the harness's) and 4 of dtrain's each.
    EXPECT_EQ(during.load() - before, 4 + 4 * 4) << "DTRAIN_TCP_STREAMS=" << streams;
  }
}

}  // namespace
}  // namespace dtrain
