// The TCP mesh at scale: rank 0 of a 1,024-rank group with a job token
// meets all its peers (2 streams each) while 256 strangers hold silent
// connections open; a full mesh of 64 ranks forms in one process; a rank
// that cannot have the descriptors it needs says so.

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "common/socket.h"
#include "dtrain/store/hash_store.h"
#include "harness/assertions.h"
#include "transport/tcp/mesh.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::Contains;
using testing::seconds_since;

transport::TcpOptions options(const std::string& token, int streams) {
  transport::TcpOptions o;
  o.streams = streams;
  o.timeout = 120s;
  o.name = "big";
  o.token = token;
  return o;
}

void raise_descriptor_limit() {
  rlimit lim{};
  getrlimit(RLIMIT_NOFILE, &lim);
  lim.rlim_cur = lim.rlim_max;
  setrlimit(RLIMIT_NOFILE, &lim);
}

// Before the handshake ran as one event loop, rank 0 held a pending
// connection for every peer until that peer's own accepts were done, and
// evicted the oldest past 256: real peers. Here 1,023 light peers (threads
// that join rank 0 only) and 256 silent strangers all connect at once.
TEST(TcpMesh, RankZeroOfA1024RankGroupWithATokenMeetsAllPeersAmidSilentStrangers) {
  raise_descriptor_limit();
  constexpr int kSize = 1024, kStreams = 2, kStrangers = 256;
  HashStore store(120s);
  const auto opts = options("s3cret", kStreams);
  const auto start = std::chrono::steady_clock::now();
  std::atomic<bool> finished{false};
  std::thread strangers([&] {
    const auto addr = store.get_string("tcp/addr/0");
    const auto nl = addr.find('\n');
    const auto port = static_cast<uint16_t>(std::stoi(addr.substr(nl + 1)));
    std::vector<net::Fd> fds;
    for (int i = 0; i < kStrangers; ++i)
      fds.push_back(net::connect_to(addr.substr(0, nl), port, net::Clock::now() + 60s));
    while (!finished) std::this_thread::sleep_for(10ms);
  });
  std::vector<std::string> errors(kSize);
  std::vector<std::thread> peers;
  for (int r = 1; r < kSize; ++r) {
    peers.emplace_back([&, r] {
      try {
        auto mesh = transport::tcp::connect_mesh(store, r, kSize, opts,
                                                 transport::tcp::MeshScope{1, false});
        for (int s = 0; s < kStreams; ++s)
          if (!mesh.conns[0][s]) errors[r] = "no connection to rank 0";
        // Kept open until rank 0 is done: a peer that left early would not
        // prove rank 0 finished its side.
        while (!finished) std::this_thread::sleep_for(10ms);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  transport::tcp::Mesh mesh;
  try {
    mesh = transport::tcp::connect_mesh(store, 0, kSize, opts);
  } catch (const std::exception& e) {
    errors[0] = e.what();
  }
  const double took = seconds_since(start);
  finished = true;
  for (auto& t : peers) t.join();
  strangers.join();
  for (int r = 0; r < kSize; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  int connections = 0;
  for (int p = 1; p < kSize; ++p)
    for (int s = 0; s < kStreams; ++s) connections += mesh.conns[p][s] ? 1 : 0;
  EXPECT_EQ(connections, (kSize - 1) * kStreams);
  std::cout << "rank 0 of " << kSize << " met " << connections << " connections amid "
            << kStrangers << " strangers in " << took << " s\n";
}

TEST(TcpMesh, AFullMeshOf64RanksWithATokenForms) {
  raise_descriptor_limit();
  constexpr int kSize = 64, kStreams = 2;
  HashStore store(120s);
  const auto opts = options("s3cret", kStreams);
  std::vector<std::string> errors(kSize);
  std::vector<int> connected(kSize);
  std::vector<std::thread> ranks;
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < kSize; ++r) {
    ranks.emplace_back([&, r] {
      try {
        auto mesh = transport::tcp::connect_mesh(store, r, kSize, opts);
        for (int p = 0; p < kSize; ++p)
          for (const auto& fd : mesh.conns[p]) connected[r] += fd ? 1 : 0;
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kSize; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(connected[r], (kSize - 1) * kStreams) << "rank " << r;
  }
  std::cout << "full mesh of " << kSize << " ranks in " << seconds_since(start) << " s\n";
}

// In a child process whose hard limit is 64 descriptors, a 200-rank group
// cannot fit: the error names the limit and the count, before connecting.
TEST(TcpMesh, TooFewDescriptorsFailNamingTheLimit) {
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(out[0]);
    rlimit lim{64, 64};
    setrlimit(RLIMIT_NOFILE, &lim);
    std::string what = "no error";
    try {
      HashStore store(5s);
      transport::tcp::connect_mesh(store, 0, 200, options("", 1));
    } catch (const std::exception& e) {
      what = e.what();
    }
    (void)!write(out[1], what.data(), what.size());
    _exit(0);
  }
  close(out[1]);
  std::string what;
  char buf[512];
  for (ssize_t n; (n = read(out[0], buf, sizeof(buf))) > 0;) what.append(buf, n);
  close(out[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(Contains(what, "group 'big' of 200 ranks needs 200 file descriptors")) << what;
  EXPECT_TRUE(Contains(what, "under a limit of 64 (RLIMIT_NOFILE")) << what;
}

}  // namespace
}  // namespace dtrain
