// A hostile client floods the store of a running job (issues 14 and 30):
// it SETs a 32 MiB value and pipelines 200 GETs of it on each of four
// connections without reading a reply. The job must train on, and rank 0,
// whose process hosts the store, must grow by at most 64 MiB beyond the
// value itself: the replies share the stored value (before issue 14's fix
// it grew by about 2.5 GB per connection; before issue 30's, by 365 MiB,
// one copy of the reply per connection).

#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>
#include <iostream>
#include <regex>
#include <thread>

#include "common/socket.h"
#include "harness/process_ranks.h"
#include "store/wire.h"

namespace dtrain::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const std::string kWorker = DTRAIN_TEST_WORKER;

size_t resident_bytes(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

// The highest "rank 0 steps N" rank 0 has printed.
long steps_of(const RankProcess& p) {
  long best = -1;
  const std::string out = p.output();
  std::regex re("rank 0 steps ([0-9]+)");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it)
    best = std::max(best, std::stol((*it)[1]));
  return best;
}

std::vector<uint8_t> frame_set(const std::string& key, const std::vector<uint8_t>& value) {
  return wire::Writer(wire::kSet, 1).str(key).bytes(value).finish();
}

TEST(StoreFlood, JobTrainsOnAndRankZeroStaysBounded) {
  const int port = free_port();
  ProcessRanks procs;
  for (int r = 0; r < 2; ++r) procs.spawn({kWorker, "loop", "tcp"}, rank_env(r, 2, port));
  auto& rank0 = procs.ranks()[0];
  const auto deadline = Clock::now() + 60s;
  while (steps_of(rank0) < 0 && Clock::now() < deadline) std::this_thread::sleep_for(50ms);
  ASSERT_GE(steps_of(rank0), 0) << rank0.output();
  const size_t rss_before = resident_bytes(rank0.pid);

  const std::vector<uint8_t> value(32 << 20, 0x42);
  std::vector<net::Fd> floods;
  for (int c = 0; c < 4; ++c) {
    floods.push_back(net::connect_to("127.0.0.1", port, net::Clock::now() + 5s));
    std::vector<uint8_t> bytes = c == 0 ? frame_set("flood", value) : std::vector<uint8_t>{};
    for (int i = 0; i < 200; ++i) {
      auto g = wire::Writer(wire::kGet, 2 + i).str("flood").u32(60000).finish();
      bytes.insert(bytes.end(), g.begin(), g.end());
    }
    net::send_all(floods.back().get(), bytes.data(), bytes.size(), net::Clock::now() + 10s, "store");
  }
  const long steps_at_flood = steps_of(rank0);
  size_t rss_peak = 0;
  for (int i = 0; i < 30; ++i) {  // 3 s of flood, nothing read
    std::this_thread::sleep_for(100ms);
    rss_peak = std::max(rss_peak, resident_bytes(rank0.pid));
  }
  std::cout << "rank 0 resident: " << (rss_before >> 20) << " MiB before the flood, peak "
            << (rss_peak >> 20) << " MiB during it; steps " << steps_at_flood << " -> "
            << steps_of(rank0) << std::endl;
  EXPECT_LT(rss_peak - std::min(rss_peak, rss_before), value.size() + (size_t(64) << 20))
      << "rank 0 grew from " << rss_before << " to " << rss_peak << " bytes";
  EXPECT_GT(steps_of(rank0), steps_at_flood) << "the job stopped training: " << rank0.output();
  for (auto& p : procs.ranks()) kill(p.pid, SIGKILL);
  procs.wait_all(10s);
}

}  // namespace
}  // namespace dtrain::testing
