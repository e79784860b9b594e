// PyTorch-style programs under OpenMPI's mpirun: rank and world read from
// its variables with the TCP store, and the mpi backend, whose rank and
// world come from MPI itself.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "harness/process_ranks.h"

namespace dtrain::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const std::string kWorker = DTRAIN_TEST_WORKER;

TEST(Mpirun, TwoRanksRunUnchanged) {
  ProcessRanks procs;
  auto& p = procs.spawn({MPIRUN_EXECUTABLE, "-np", "2", "--allow-run-as-root", "--oversubscribe",
                         "-x", "MASTER_ADDR=127.0.0.1", "-x",
                         "MASTER_PORT=" + std::to_string(free_port()), "-x", "DTRAIN_TIMEOUT=60",
                         kWorker, "collectives"},
                        {{"OMPI_MCA_plm_rsh_agent", ""}});
  ASSERT_TRUE(procs.wait(p, Clock::now() + 120s)) << "mpirun did not finish: " << p.output();
  EXPECT_EQ(p.exit_code, 0) << describe(p);
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(p.output().find("rank " + std::to_string(r) + " ok"), std::string::npos) << describe(p);
}

// The mpi backend: rank and world from mpirun itself (no MASTER_ADDR).
class MpiBackend : public ::testing::TestWithParam<int> {
 protected:
  RankProcess& mpirun(ProcessRanks& procs, const std::vector<std::string>& args) {
    std::vector<std::string> argv = {MPIRUN_EXECUTABLE, "-np", std::to_string(GetParam()),
                                     "--allow-run-as-root", "--oversubscribe", "-x",
                                     "DTRAIN_TIMEOUT=60", kWorker};
    argv.insert(argv.end(), args.begin(), args.end());
    return procs.spawn(argv, {{"OMPI_MCA_plm_rsh_agent", ""}});
  }
  // mpirun with `args` ends within `limit` with status 0, and each rank R
  // printed "rank R <said>".
  void expect_each_rank_says(const std::vector<std::string>& args, const std::string& said,
                             std::chrono::seconds limit = 120s) {
    ProcessRanks procs;
    auto& p = mpirun(procs, args);
    ASSERT_TRUE(procs.wait(p, Clock::now() + limit)) << "mpirun did not finish: " << p.output();
    EXPECT_EQ(p.exit_code, 0) << describe(p);
    for (int r = 0; r < GetParam(); ++r)
      EXPECT_NE(p.output().find("rank " + std::to_string(r) + " " + said), std::string::npos)
          << describe(p);
  }
};

TEST_P(MpiBackend, EveryCollectiveAndDtypeIsExact) {
  expect_each_rank_says({"matrix", "mpi"}, "matrix ok on mpi", 180s);
}

// The last rank skips the second monitored_barrier: rank 0 names it and
// tells the others; mpirun's processes all end.
TEST_P(MpiBackend, MonitoredBarrierNamesTheMissingRank) {
  ProcessRanks procs;
  auto& p = mpirun(procs, {"monitored", "mpi"});
  ASSERT_TRUE(procs.wait(p, Clock::now() + 120s)) << "mpirun did not finish: " << p.output();
  const int last = GetParam() - 1;
  for (int r = 0; r < GetParam(); ++r)
    EXPECT_NE(p.output().find("rank " + std::to_string(r) + " passed the monitored barrier"),
              std::string::npos) << describe(p);
  const std::string n = std::to_string(GetParam());
  EXPECT_NE(p.output().find("on group 'default' (rank 0/" + n + ", backend mpi): rank " +
                            std::to_string(last) + " did not arrive within 1000 ms"),
            std::string::npos) << describe(p);
  if (last > 1)
    EXPECT_NE(p.output().find("on group 'default' (rank 1/" + n + ", backend mpi" +
                              "): rank 0 found ranks that did not arrive within 1000 ms"),
              std::string::npos) << describe(p);
}

// Before, one thread completed p2p requests in posting order: rank 0's send
// waited behind its earlier receive until the timeout.
TEST_P(MpiBackend, EachSendAndRecvCompletesOnItsOwn) {
  expect_each_rank_says({"p2p-order", "mpi"}, "p2p order ok on mpi");
}

TEST_P(MpiBackend, DdpMatchesSingleProcessTraining) {
  expect_each_rank_says({"ddp-equivalence", "mpi"}, "ddp matches single-process training on mpi");
}

TEST_P(MpiBackend, FsdpMatchesSingleProcessTraining) {
  expect_each_rank_says({"fsdp-equivalence", "mpi"}, "fsdp matches single-process training on mpi");
}

TEST_P(MpiBackend, Zero1AndZero2MatchSingleProcessTraining) {
  for (const std::string name : {"zero1", "zero2"})
    expect_each_rank_says({name + "-equivalence", "mpi"}, name + " matches single-process training on mpi");
}

INSTANTIATE_TEST_SUITE_P(World, MpiBackend, ::testing::Values(2, 3, 4));

}  // namespace
}  // namespace dtrain::testing
