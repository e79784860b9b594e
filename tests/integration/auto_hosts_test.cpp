// Backend auto over two "hosts" that are one machine split by
// DTRAIN_HOST_ID, two ranks on each, as real processes: one group
// (shared-memory rings inside a host, TCP across) that says so at
// DTRAIN_DEBUG=INFO, runs every collective exactly, and under DDP equals one
// process on the whole batch. (netns.TwoHostsFourRanks does the same across
// network namespaces; process_test.cpp kills a peer of such a group.)

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "harness/process_ranks.h"

namespace dtrain::testing {
namespace {

using namespace std::chrono_literals;

const std::string kWorker = DTRAIN_TEST_WORKER;

// Starts 4 ranks of `argv` on host ids a (ranks 0, 1) and b (ranks 2, 3).
void spawn_on_two_host_ids(ProcessRanks& procs, const std::vector<std::string>& argv,
                           std::map<std::string, std::string> extra = {}) {
  const int port = free_port();
  for (int r = 0; r < 4; ++r) {
    auto env = rank_env(r, 4, port);
    env["DTRAIN_HOST_ID"] = r < 2 ? "a" : "b";
    for (const auto& [k, v] : extra) env[k] = v;
    procs.spawn(argv, env);
  }
}

TEST(AutoOverHosts, TwoHostIdsOfTwoRanksRunEveryCollective) {
  ProcessRanks procs;
  spawn_on_two_host_ids(procs, {kWorker, "collectives", "env://", "auto"}, {{"DTRAIN_DEBUG", "INFO"}});
  ASSERT_TRUE(procs.wait_all(90s)) << "ranks did not finish";
  for (int r = 0; r < 4; ++r) {
    auto& p = procs.ranks()[r];
    const auto out = p.output(), me = "rank " + std::to_string(r);
    EXPECT_EQ(p.exit_code, 0) << describe(p);
    EXPECT_NE(out.find(me + " ok"), std::string::npos) << describe(p);
    EXPECT_NE(out.find(me + " backend auto (shm within 2 machines, tcp between)"), std::string::npos)
        << describe(p);
    EXPECT_NE(out.find("spans 2 hosts (ranks 0,1 | ranks 2,3): shared-memory rings within a "
                       "host, tcp between; all_reduce, all_gather and reduce_scatter above "
                       "64 KiB in two levels"),
              std::string::npos) << describe(p);
  }
}

TEST(AutoOverHosts, DdpOverTwoHostIdsMatchesSingleProcessTraining) {
  ProcessRanks procs;
  spawn_on_two_host_ids(procs, {kWorker, "ddp-equivalence", "auto", "wide"});  // two-level buckets
  ASSERT_TRUE(procs.wait_all(120s)) << "ranks did not finish";
  for (int r = 0; r < 4; ++r) {
    auto& p = procs.ranks()[r];
    EXPECT_EQ(p.exit_code, 0) << describe(p);
    EXPECT_NE(p.output().find("rank " + std::to_string(r) + " ddp matches single-process "
                              "training on auto"), std::string::npos) << describe(p);
  }
}

}  // namespace
}  // namespace dtrain::testing
