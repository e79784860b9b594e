// monitored_barrier on the backends built on the tcp transport (tcp, shm,
// auto): ranks that all arrive pass and the group works on; a rank that
// does not arrive is named on rank 0 (the first one, or every one with
// wait_all_ranks) within the timeout, and the ranks that did arrive hear
// from rank 0 that the barrier failed. (mpi: process_test's
// MpiBackend.MonitoredBarrier*.)

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <set>
#include <thread>

#include "harness/assertions.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::Contains;
using testing::expect_no_errors;

class MonitoredBarrier : public ::testing::TestWithParam<std::string> {
 protected:
  std::vector<std::string> run(int world, const std::function<void(ProcessGroup&)>& body) {
    return testing::run_ranks(world, body, 30s, GroupOptions(), GetParam());
  }

  // Ranks in `skip` stay away (past the timeout); every other rank calls a
  // monitored_barrier of 500 ms. Returns each rank's error message (empty
  // for the ones that stayed away) and rank 0's time to fail.
  std::vector<std::string> with_missing(int world, const std::set<int>& skip, bool wait_all,
                                        double* rank0_seconds) {
    std::vector<std::string> what(world);
    auto errors = run(world, [&](ProcessGroup& g) {
      if (skip.count(g.rank())) {
        std::this_thread::sleep_for(1500ms);
        return;
      }
      const auto start = Clock::now();
      try {
        g.monitored_barrier(500ms, wait_all)->wait();
      } catch (const TimeoutError& e) {
        what[g.rank()] = e.what();
      }
      if (g.rank() == 0)
        *rank0_seconds = std::chrono::duration<double>(Clock::now() - start).count();
    });
    for (const auto& e : errors) EXPECT_EQ(e, "");
    return what;
  }
};

TEST_P(MonitoredBarrier, RanksThatAllArrivePassAndTheGroupWorksOn) {
  expect_no_errors(run(3, [](ProcessGroup& g) {
    g.monitored_barrier(5000ms)->wait();
    g.monitored_barrier(5000ms, /*wait_all_ranks=*/true)->wait();
    auto t = at::ones({4});
    g.all_reduce(t)->wait();
    EXPECT_TRUE(at::equal(t, at::full({4}, 3.f)));
  }));
}

TEST_P(MonitoredBarrier, RankZeroNamesTheFirstMissingRank) {
  double seconds = 0;
  auto what = with_missing(4, {2, 3}, /*wait_all=*/false, &seconds);
  EXPECT_TRUE(Contains(what[0], "rank 2 did not arrive within 500 ms (the first such rank; "
                                "wait_all_ranks names them all)"))
      << what[0];
  EXPECT_LT(seconds, 1.5);
  EXPECT_TRUE(Contains(what[1], "rank 0 found ranks that did not arrive within 500 ms (its "
                                "error names them)"))
      << what[1];
}

TEST_P(MonitoredBarrier, WaitAllRanksNamesEveryMissingRank) {
  double seconds = 0;
  auto what = with_missing(4, {1, 3}, /*wait_all=*/true, &seconds);
  EXPECT_TRUE(Contains(what[0], "ranks 1, 3 did not arrive within 500 ms")) << what[0];
  EXPECT_FALSE(Contains(what[0], "first such rank")) << what[0];
  EXPECT_LT(seconds, 1.5);
  EXPECT_TRUE(Contains(what[2], "rank 0 found ranks that did not arrive within 500 ms")) << what[2];
}

INSTANTIATE_TEST_SUITE_P(Backends, MonitoredBarrier, ::testing::Values("tcp", "shm", "auto"));

}  // namespace
}  // namespace dtrain
