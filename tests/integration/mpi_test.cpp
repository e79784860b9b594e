// The mpi backend after a timeout (the memory MPI may still write into),
// after ranks called a collective with sizes that do not pair up, and at
// its int limits.
//
// One binary, two roles: run plainly it is the gtest binary; the two-rank
// tests start `mpirun -np 2 <this binary> worker MODE`, whose ranks talk
// through dtrain's mpi group and signal each other on MPI_COMM_WORLD (a
// channel the test controls, apart from the group under test). Meant to run
// under AddressSanitizer in CI too: a late MPI write into freed memory is
// then a heap-use-after-free report, not only a changed sentinel.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <climits>
#include <iostream>

#include "backends/mpi/backend.h"
#include "dtrain/dtrain.h"
#include "harness/process_ranks.h"

namespace dtrain::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// --- the ranks -----------------------------------------------------------------

constexpr int64_t kN = 300;         // 1200 bytes of float: Open MPI sends it eagerly
constexpr int kSentinels = 64;      // allocations of the freed buffer's size
constexpr int kGo = 901, kDone = 902;  // tags on MPI_COMM_WORLD
constexpr auto kShort = std::chrono::milliseconds(300);

void signal_peer(int peer, int tag) {
  int x = 0;
  MPI_Send(&x, 1, MPI_INT, peer, tag, MPI_COMM_WORLD);
}

void await_peer(int peer, int tag) {
  int x = 0;
  MPI_Recv(&x, 1, MPI_INT, peer, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
}

int fail(int rank, const std::string& what) {
  std::cout << "FAILED rank " << rank << ": " << what << std::endl;
  return 1;
}

// Waits on `work`; an empty string when it threw TimeoutError, else what happened.
std::string expect_timeout(const WorkPtr& work) {
  try {
    work->wait();
  } catch (const TimeoutError&) {
    return "";
  } catch (const std::exception& e) {
    return std::string("threw something else: ") + e.what();
  }
  return "completed without a peer";
}

// Same-sized allocations after the release: some reuse the freed memory.
std::vector<at::Tensor> sentinels() {
  std::vector<at::Tensor> out;
  for (int i = 0; i < kSentinels; ++i) out.push_back(at::full({kN}, 7.0f));
  return out;
}

int check_sentinels(int rank, const std::vector<at::Tensor>& all) {
  for (const auto& s : all)
    if (!at::equal(s, at::full({kN}, 7.0f)))
      return fail(rank, "memory released after the timeout was written by MPI: sentinel holds " +
                            std::to_string(s.max().item<float>()));
  return 0;
}

// Rank 1 receives twice and times out (rank 0 has not sent): one buffer it
// keeps, the other it lets go of. Then rank 0 sends both messages late.
int late_recv(int rank) {
  auto group = default_group();
  if (rank == 0) {
    await_peer(1, kGo);
    group->send(at::full({kN}, 42.0f), 1, /*tag=*/1, 10s)->wait();
    group->send(at::full({kN}, 42.0f), 1, /*tag=*/2, 10s)->wait();
    signal_peer(1, kDone);  // after the sends, on the same link: they arrived first
    MPI_Barrier(MPI_COMM_WORLD);
    return 0;
  }
  auto kept = at::full({kN}, -1.0f);
  auto kept_work = group->recv(kept, 0, 1, kShort);
  auto released_work = group->recv(at::full({kN}, -2.0f), 0, 2, kShort);
  for (const auto& work : {kept_work, released_work})
    if (auto what = expect_timeout(work); !what.empty()) return fail(rank, "recv " + what);
  auto later = sentinels();
  for (int i = 0; i < 100; ++i) at::empty({kN * (i % 7 + 1)}).fill_(i);  // keeps running
  signal_peer(0, kGo);
  await_peer(0, kDone);
  MPI_Barrier(MPI_COMM_WORLD);  // more progress for anything still pending
  if (!at::equal(kept, at::full({kN}, -1.0f)))
    return fail(rank, "the receive buffer was written after its TimeoutError");
  if (int rc = check_sentinels(rank, later)) return rc;
  if (size_t n = mpi_backend::requests_in_flight(); n != 0)
    return fail(rank, std::to_string(n) + " cancelled receives still in flight");
  try {
    group->barrier(10s)->wait();
    return fail(rank, "the group was not broken by the timeout");
  } catch (const NetworkError& e) {
    if (std::string(e.what()).find("the group is broken") == std::string::npos)
      return fail(rank, std::string("unexpected error after the timeout: ") + e.what());
  }
  return 0;
}

// Rank 1's all_reduce times out (rank 0 has not joined) and rank 1 lets go
// of its tensor; then rank 0 joins: MPI completes rank 1's half late.
int late_collective(int rank) {
  auto group = default_group();
  if (rank == 0) {
    await_peer(1, kGo);
    auto x = at::full({kN}, 42.0f);
    group->all_reduce(x, ReduceOp::SUM, 30s)->wait();
    signal_peer(1, kDone);
    MPI_Barrier(MPI_COMM_WORLD);
    // Rank 1 took part with what it had posted before its timeout.
    return at::equal(x, at::full({kN}, 43.0f)) ? 0 : fail(rank, "late all_reduce result");
  }
  auto work = group->all_reduce(at::full({kN}, 1.0f), ReduceOp::SUM, kShort);
  if (auto what = expect_timeout(work); !what.empty()) return fail(rank, "all_reduce " + what);
  auto later = sentinels();
  for (int i = 0; i < 100; ++i) at::empty({kN * (i % 7 + 1)}).fill_(i);
  signal_peer(0, kGo);
  // MPI progresses while the request is tested; it finishes once rank 0 joins.
  const auto deadline = Clock::now() + 30s;
  while (mpi_backend::requests_in_flight() != 0)
    if (Clock::now() > deadline) return fail(rank, "the late all_reduce never completed");
  await_peer(0, kDone);
  MPI_Barrier(MPI_COMM_WORLD);
  return check_sentinels(rank, later);
}

// An all_to_all whose sizes do not pair up: rank 1 sends rank 0 three
// elements where rank 0 posted two. Rank 0's MPI reports the truncation,
// which is a CollectiveMismatch naming the call, as on the other backends;
// both ranks have finished the collective, so the group stays usable (as
// after an InvalidArgument): the next all_reduce works on both.
int mismatch(int rank) {
  auto group = default_group();
  std::vector<at::Tensor> inputs = {at::ones({2}), at::ones({rank == 1 ? 3 : 2})};
  if (rank == 1) std::swap(inputs[0], inputs[1]);  // rank 1: 3 elements to rank 0
  std::vector<at::Tensor> outputs = {at::zeros({2}), at::zeros({2})};
  auto work = group->all_to_all(outputs, inputs, 10s);
  if (rank == 0) {
    try {
      work->wait();
      return fail(rank, "the mismatched all_to_all succeeded");
    } catch (const CollectiveMismatch& e) {
      const std::string what = e.what();
      for (const std::string part :
           {"all_to_all #0 on group 'default' (rank 0/2, backend mpi)",
            "a peer sent more than this rank expected (MPI: ",
            "the ranks called collectives of different sizes"})
        if (what.find(part) == std::string::npos)
          return fail(rank, "the CollectiveMismatch does not say '" + part + "': " + what);
    } catch (const std::exception& e) {
      return fail(rank, std::string("not a CollectiveMismatch: ") + e.what());
    }
  } else {
    work->wait();
  }
  auto t = at::ones({4});
  try {
    group->all_reduce(t, ReduceOp::SUM, 10s)->wait();
  } catch (const std::exception& e) {
    return fail(rank, std::string("the group is unusable after the mismatch: ") + e.what());
  }
  if (!at::equal(t, at::full({4}, 2.0f))) return fail(rank, "wrong all_reduce after the mismatch");
  return 0;
}

// Rank 1 posts a receive that rank 0 never answers, under the group's
// default timeout (30 min), and destroys the group: that takes seconds, not
// the timeout, and the receive fails naming the destroyed group. Then the
// same on the default group when main returns without destroying it.
int destroy_pending(int rank) {
  // Made directly, so that this is its last reference.
  const auto options = GroupOptions().name("own");
  auto mpi = std::make_shared<mpi_backend::MpiBackend>(rank, 2, options);
  auto group = std::make_shared<ProcessGroup>(rank, 2, options,
                                              DeviceBackends{{c10::DeviceType::CPU, mpi}});
  mpi.reset();
  WorkPtr work;
  if (rank == 1) work = group->recv(at::zeros({kN}), 0, /*tag=*/5);
  const auto start = Clock::now();
  group.reset();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (rank == 1) {
    if (seconds > 5) return fail(rank, "destroying the group took " + std::to_string(seconds) + " s");
    try {
      work->wait();
      return fail(rank, "the receive completed without a message");
    } catch (const NetworkError& e) {
      if (std::string(e.what()).find("group 'own' was destroyed while this operation was pending") ==
          std::string::npos)
        return fail(rank, std::string("the receive's error does not name the destroyed group: ") + e.what());
    } catch (const std::exception& e) {
      return fail(rank, std::string("the receive failed with something else: ") + e.what());
    }
    std::cout << "rank 1 destroyed its group in " << seconds << " s" << std::endl;
    default_group()->recv(at::zeros({kN}), 0, /*tag=*/6);  // pending when main returns
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return 0;
}

int run_worker(const std::string& mode) {
  init_process_group(InitOptions().backend("mpi"));
  const int rank = get_rank();
  if (get_world_size() != 2) return fail(rank, "run with mpirun -np 2");
  const int rc = mode == "late-recv"         ? late_recv(rank)
                 : mode == "mismatch"        ? mismatch(rank)
                 : mode == "destroy-pending" ? destroy_pending(rank)
                                             : late_collective(rank);
  if (rc == 0) std::cout << "rank " << rank << " " << mode << " ok" << std::endl;
  if (mode == "destroy-pending") return rc;  // the default group goes at exit, a receive pending
  destroy_process_group();
  return rc;
}

// --- the tests -------------------------------------------------------------------

std::string self_path() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : std::string();
}

void expect_two_ranks_pass(const std::string& mode, std::chrono::seconds limit = 120s) {
  ProcessRanks procs;
  auto& p = procs.spawn({MPIRUN_EXECUTABLE, "-np", "2", "--allow-run-as-root", "--oversubscribe",
                         self_path(), "worker", mode},
                        {{"OMPI_MCA_plm_rsh_agent", ""}});
  ASSERT_TRUE(procs.wait(p, Clock::now() + limit)) << "mpirun did not finish: " << p.output();
  EXPECT_EQ(p.exit_code, 0) << p.output();
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(p.output().find("rank " + std::to_string(r) + " " + mode + " ok"),
              std::string::npos)
        << p.output();
}

TEST(MpiTimeout, TimedOutRecvIsCancelledAndItsBuffersNeverWritten) {
  expect_two_ranks_pass("late-recv");
}

TEST(MpiTimeout, TimedOutCollectiveKeepsItsBuffersUntilMpiIsDone) {
  expect_two_ranks_pass("late-collective");
}

// Without cancelling, each destroy would wait for the receive's timeout:
// 30 minutes.
TEST(MpiTeardown, DestroyingAGroupOrExitingEndsPendingReceivesAtOnce) {
  expect_two_ranks_pass("destroy-pending", 60s);
}

TEST(MpiErrors, ACollectiveMismatchFailsTheCallAndLeavesTheGroupUsable) {
  expect_two_ranks_pass("mismatch");
}

std::string error_of(const std::vector<int64_t>& numels) {
  try {
    mpi_backend::peer_counts(numels, "all_to_all #7 on group 'default' (rank 0/3)");
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(MpiCounts, DisplacementsAreSummedIn64Bits) {
  const int64_t half = int64_t(1) << 30;
  auto c = mpi_backend::peer_counts({half, half - 1, 1}, "all_to_all");
  EXPECT_EQ(c.counts, (std::vector<int>{int(half), int(half - 1), 1}));
  EXPECT_EQ(c.displacements, (std::vector<int>{0, int(half), INT_MAX}));
  EXPECT_EQ(c.total, int64_t(INT_MAX) + 1);  // the last displacement still fits
}

TEST(MpiCounts, DisplacementOverIntMaxIsRefusedNamingTheCall) {
  const int64_t half = int64_t(1) << 30;
  const auto what = error_of({half, half, 5});  // rank 2 would start at 2^31
  EXPECT_NE(what.find("all_to_all #7 on group 'default'"), std::string::npos) << what;
  EXPECT_NE(what.find("displacements are int"), std::string::npos) << what;
  EXPECT_NE(what.find("2147483648 elements"), std::string::npos) << what;
}

TEST(MpiCounts, CountOverIntMaxIsRefusedNamingTheCall) {
  const auto what = error_of({1, int64_t(INT_MAX) + 1, 1});
  EXPECT_NE(what.find("all_to_all #7 on group 'default'"), std::string::npos) << what;
  EXPECT_NE(what.find("2147483648 elements for rank 1"), std::string::npos) << what;
}

}  // namespace
}  // namespace dtrain::testing

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "worker") {
    try {
      return dtrain::testing::run_worker(argv[2]);
    } catch (const std::exception& e) {
      std::cout << "caught: " << e.what() << std::endl;
      return 3;
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
