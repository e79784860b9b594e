// The shm backend beyond the shared exactness matrix (collectives_test.cpp):
// many small pieces, mismatches caught natively, concurrent groups,
// timeouts and departed peers, and /dev/shm hygiene.

#include <ATen/ATen.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <thread>

#include "common/paths.h"
#include "transport/shm/segment.h"
#include "common/enforce.h"
#include "harness/assertions.h"
#include "harness/exact_values.h"
#include "harness/scoped_env.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::Contains;
using testing::expect_no_errors;

std::vector<std::string> run_shm(int world, const std::function<void(ProcessGroup&)>& body,
                                 std::chrono::milliseconds timeout = 30s) {
  return testing::run_ranks(world, body, timeout, GroupOptions(), "shm");
}

using testing::ScopedEnv;

// ((i + seed) mod 5) + 1: one period computed, then tiled (memcpy's speed).
at::Tensor values(int seed, int64_t n, at::ScalarType dt) {
  return testing::tiled((at::fmod(at::arange(5, at::kDouble) + seed, 5) + 1).to(dt), n);
}

TEST(Shm, EveryCollectiveAcrossManySmallPieces) {
  // 4 KiB steps: every collective below takes many pieces, none a multiple
  // of the piece or of the vector width.
  ScopedEnv chunk("DTRAIN_SHM_CHUNK_BYTES", "4096");
  const int W = 3;
  for (auto dt : {at::kFloat, at::kHalf, at::kLong}) {
    expect_no_errors(run_shm(W, [&](ProcessGroup& g) {
      const int me = g.rank();
      const int64_t n = 5003;
      auto sum = values(0, n, at::kDouble) + values(1, n, at::kDouble) + values(2, n, at::kDouble);
      auto t = values(me, n, dt);
      g.all_reduce(t)->wait();
      EXPECT_TRUE(at::equal(t, sum.to(dt))) << "all_reduce " << dt;

      auto r = values(me, n, dt);
      g.reduce(r, 2)->wait();
      EXPECT_TRUE(at::equal(r, me == 2 ? sum.to(dt) : values(me, n, dt))) << "reduce " << dt;

      auto b = values(me, n, dt);
      g.broadcast(b, 1)->wait();
      EXPECT_TRUE(at::equal(b, values(1, n, dt))) << "broadcast " << dt;

      std::vector<at::Tensor> outs(W);
      for (auto& o : outs) o = at::zeros({n}, dt);
      g.all_gather(outs, values(me, n, dt))->wait();
      for (int j = 0; j < W; ++j) EXPECT_TRUE(at::equal(outs[j], values(j, n, dt))) << "all_gather";

      std::vector<at::Tensor> pieces;
      if (me == 0)
        for (int j = 0; j < W; ++j) pieces.push_back(values(7 + j, n, dt));
      auto got = at::zeros({n}, dt);
      g.scatter(got, pieces, 0)->wait();
      EXPECT_TRUE(at::equal(got, values(7 + me, n, dt))) << "scatter " << dt;

      std::vector<at::Tensor> parts;
      for (int j = 0; j < W; ++j) parts.push_back(values(me + 10 * j, n, dt));
      auto mine = at::zeros({n}, dt);
      g.reduce_scatter(mine, parts)->wait();
      auto want = values(10 * me, n, at::kDouble) + values(1 + 10 * me, n, at::kDouble) +
                  values(2 + 10 * me, n, at::kDouble);
      EXPECT_TRUE(at::equal(mine, want.to(dt))) << "reduce_scatter " << dt;

      std::vector<at::Tensor> in, out;
      for (int j = 0; j < W; ++j) {
        in.push_back(values(me * W + j, 1000 * (me + j) + 17, dt));
        out.push_back(at::zeros({1000 * (j + me) + 17}, dt));
      }
      g.all_to_all(out, in)->wait();
      for (int j = 0; j < W; ++j)
        EXPECT_TRUE(at::equal(out[j], values(j * W + me, 1000 * (j + me) + 17, dt)))
            << "all_to_all from " << j;
    }));
  }
}

TEST(Shm, LargeMisalignedAllReduceIsExactAndStaysInItsView) {
  // Larger than the caches, an odd length, at an address that is not
  // 16-byte aligned (vector head and tail); the elements around the view
  // stay untouched.
  for (int W : {2, 3}) {
    expect_no_errors(run_shm(W, [&](ProcessGroup& g) {
      const int64_t n = 6'000'001;
      auto base = at::full({n + 2}, -7.0f);
      auto view = base.narrow(0, 1, n);
      view.copy_(values(g.rank(), n, at::kFloat));
      g.all_reduce(view, ReduceOp::SUM)->wait();
      auto want = values(0, n, at::kDouble);
      for (int r = 1; r < W; ++r) want = want + values(r, n, at::kDouble);
      EXPECT_TRUE(at::equal(view, want.to(at::kFloat))) << "world " << W;
      EXPECT_EQ(base[0].item<float>(), -7.0f);
      EXPECT_EQ(base[n + 1].item<float>(), -7.0f);
    }));
  }
}

TEST(Shm, MismatchedCollectivesAreCaughtWithoutDebugAndTheGroupStaysUsable) {
  auto errors = run_shm(2, [](ProcessGroup& g) {
    // After each mismatch the ranks must still agree on the shared buffers:
    // a multi-chunk all_reduce and broadcast come out exact.
    // (New values each time, so stale data in the wrong half cannot pass.)
    double round = 0;
    auto still_agree = [&](const char* after) {
      round += 1;
      auto big = at::full({300001}, (g.rank() + 1.0) * round);
      g.all_reduce(big)->wait();
      EXPECT_TRUE(at::equal(big, at::full({300001}, 3.0 * round))) << "all_reduce after " << after;
      auto b = at::full({300001}, g.rank() == 1 ? 5.0 * round : 0.0);
      g.broadcast(b, 1)->wait();
      EXPECT_TRUE(at::equal(b, at::full({300001}, 5.0 * round))) << "broadcast after " << after;
    };
    auto t = at::ones({8});
    try {
      if (g.rank() == 0) g.all_reduce(t)->wait();
      else g.broadcast(t, 0)->wait();
      ADD_FAILURE() << "rank " << g.rank() << ": mismatch went unnoticed";
    } catch (const CollectiveMismatch& e) {
      EXPECT_TRUE(Contains(e.what(), "rank 0: all_reduce #0(Float, 8 elements, SUM)"));
      EXPECT_TRUE(Contains(e.what(), "rank 1: broadcast #0(Float, 8 elements, root 0)"));
    }
    still_agree("all_reduce against broadcast");
    // Sizes that differ are a mismatch too, also when one spans many chunks.
    EXPECT_THROW(g.all_reduce(at::ones({g.rank() + 1}))->wait(), CollectiveMismatch);
    EXPECT_THROW(g.all_reduce(at::ones({g.rank() == 0 ? 10 : 100000}))->wait(),
                 CollectiveMismatch);
    still_agree("all_reduce of different sizes");
    EXPECT_THROW((g.rank() == 0 ? g.all_reduce(at::ones({100000})) : g.barrier())->wait(),
                 CollectiveMismatch);
    still_agree("all_reduce against barrier");
    std::vector<at::Tensor> two = {at::ones({3}), at::ones({3})};
    EXPECT_THROW(
        (g.rank() == 0 ? g.all_to_all(two, two) : g.broadcast(at::ones({100000}), 0))->wait(),
        CollectiveMismatch);
    still_agree("all_to_all against broadcast");
  });
  expect_no_errors(errors);
}

TEST(Shm, DebugDetailFingerprintsDoNotDisturbTheStamps) {
  // DTRAIN_DEBUG=DETAIL runs a fingerprint all_gather under each call's
  // sequence number just before it: many matching calls must pass.
  expect_no_errors(testing::run_ranks(
      3,
      [](ProcessGroup& g) {
        for (int k = 0; k < 150; ++k) {
          auto t = at::full({1 + 97 * (k % 5)}, double(g.rank()));
          g.all_reduce(t, ReduceOp::MAX)->wait();
          EXPECT_TRUE(at::equal(t, at::full({1 + 97 * (k % 5)}, 2.0)));
          if (k % 7 == 0) g.barrier()->wait();
          if (k % 11 == 0) {
            std::vector<at::Tensor> in(3, at::ones({2})), out(3, at::zeros({2}));
            for (auto& o : out) o = at::zeros({2});
            g.all_to_all(out, in)->wait();
          }
        }
      },
      30s, GroupOptions().check_collectives(true), "shm"));
}

TEST(Shm, AllToAllSizeDisagreementIsNamedOnEveryRank) {
  auto errors = run_shm(2, [](ProcessGroup& g) {
    // Rank 1 expects 5 elements from rank 0, which sends 4.
    std::vector<at::Tensor> in = {at::ones({4}), at::ones({4})};
    std::vector<at::Tensor> out = {at::zeros({g.rank() == 1 ? 5 : 4}), at::zeros({4})};
    try {
      g.all_to_all(out, in)->wait();
      ADD_FAILURE() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(Contains(e.what(), "rank 0 sends 16 bytes to rank 1, which expects 20 bytes"));
    }
  });
  expect_no_errors(errors);
}

TEST(Shm, TwoGroupsOfTheSameRanksRunConcurrently) {
  expect_no_errors(testing::run_rank_contexts(
      3,
      [](testing::RankContext& ctx) {
        auto second = create_process_group(
            "shm", std::make_shared<PrefixStore>("second", ctx.store), ctx.rank, ctx.world,
            GroupOptions().name("second"));
        std::vector<at::Tensor> a, b;
        std::vector<WorkPtr> works;
        for (int k = 0; k < 20; ++k) {
          a.push_back(at::full({70000 + k}, ctx.rank + 1.0));
          b.push_back(at::full({3000 + k}, 10.0 * (ctx.rank + 1), at::kDouble));
          works.push_back(ctx.group->all_reduce(a.back()));
          works.push_back(second->all_reduce(b.back(), ReduceOp::MAX));
        }
        for (auto& w : works) w->wait();
        for (int k = 0; k < 20; ++k) {
          EXPECT_TRUE(at::equal(a[k], at::full({70000 + k}, 6.0)));
          EXPECT_TRUE(at::equal(b[k], at::full({3000 + k}, 30.0, at::kDouble)));
        }
      },
      30s, GroupOptions(), "shm"));
}

TEST(Shm, SilentPeerTimesOutAndBreaksTheGroup) {
  std::atomic<bool> rank0_done{false};
  auto errors = run_shm(
      2,
      [&](ProcessGroup& g) {
        if (g.rank() == 1) {
          while (!rank0_done) std::this_thread::sleep_for(10ms);
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        try {
          g.all_reduce(at::ones({16}), ReduceOp::SUM, 400ms)->wait();
          ADD_FAILURE() << "no timeout";
        } catch (const TimeoutError& e) {
          EXPECT_TRUE(Contains(e.what(), "timed out waiting for rank 1"));
        }
        EXPECT_GE(testing::seconds_since(start), 0.35);
        EXPECT_LE(testing::seconds_since(start), 2.0);
        try {
          g.all_reduce(at::ones({16}))->wait();
          ADD_FAILURE() << "a broken group ran a collective";
        } catch (const NetworkError& e) {
          EXPECT_TRUE(Contains(e.what(), "the group is broken by an earlier error"));
        }
        rank0_done = true;
      },
      5s);
  expect_no_errors(errors);
}

TEST(Shm, PeerThatDestroyedItsGroupIsReportedAtOnce) {
  std::atomic<bool> rank1_gone{false};
  auto errors = testing::run_rank_contexts(
      2,
      [&](testing::RankContext& ctx) {
        if (ctx.rank == 1) {
          ctx.group.reset();  // closes its mapping: its liveness lock goes
          rank1_gone = true;
          return;
        }
        while (!rank1_gone) std::this_thread::sleep_for(1ms);
        const auto start = std::chrono::steady_clock::now();
        try {
          ctx.group->all_reduce(at::ones({16}))->wait();
          ADD_FAILURE() << "no error";
        } catch (const NetworkError& e) {
          EXPECT_TRUE(Contains(e.what(), "rank 1 exited, was killed, or destroyed the group"));
        }
        EXPECT_LT(testing::seconds_since(start), 1.0);  // not the 20 s timeout
      },
      20s, GroupOptions(), "shm");
  expect_no_errors(errors);
}

bool in_dev_shm(const std::string& name) {
  return paths::exists("/dev/shm/" + name);
}

TEST(Shm, SegmentsLeftByACrashedCreatorAreRemovedOnTheNextStart) {
  // A child creates two segments under our naming scheme and dies without
  // unlinking them, as a rank 0 killed during setup would.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    for (const char* tag : {"a", "b"}) {
      const auto name = detail::cat("/", shm::kSegmentPrefix, ::getpid(), ".0.", tag);
      int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0 || ::ftruncate(fd, 4096) != 0) ::_exit(1);
    }
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_EQ(WEXITSTATUS(status), 0);
  const auto stale = detail::cat(shm::kSegmentPrefix, child, ".0.a");
  const auto held = detail::cat(shm::kSegmentPrefix, child, ".0.b");
  ASSERT_TRUE(in_dev_shm(stale));
  // Someone still holds a liveness lock on the second: it must survive.
  int fd = ::shm_open(("/" + held).c_str(), O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_len = 1;
  ASSERT_EQ(::fcntl(fd, F_OFD_SETLK, &fl), 0);

  expect_no_errors(run_shm(2, [](ProcessGroup& g) { g.barrier()->wait(); }));
  EXPECT_FALSE(in_dev_shm(stale)) << "a crashed creator's segment was left in /dev/shm";
  EXPECT_TRUE(in_dev_shm(held)) << "a segment in use was removed";
  ::close(fd);
  ::shm_unlink(("/" + held).c_str());
}

// Names this process's groups put in /dev/shm (thread ranks share its pid).
std::vector<std::string> own_names() {
  std::vector<std::string> found;
  const auto prefix = detail::cat(shm::kSegmentPrefix, ::getpid(), ".");
  for (const auto& name : paths::list("/dev/shm"))
    if (name.rfind(prefix, 0) == 0) found.push_back(name);
  return found;
}

// DTRAIN_SHM_DISABLE=1, as NCCL_SHM_DISABLE: auto goes over tcp even on one
// machine, and an explicit shm group is refused, naming the variable.
TEST(ShmDisable, AutoUsesTcpOnOneMachineAndShmIsRefused) {
  ScopedEnv off("DTRAIN_SHM_DISABLE", "1");
  expect_no_errors(testing::run_ranks(2, [](ProcessGroup& g) {
    EXPECT_EQ(g.backend_name().rfind("tcp", 0), 0u) << g.backend_name();
    auto t = at::full({5}, float(g.rank() + 1));
    g.all_reduce(t)->wait();
    EXPECT_TRUE(at::equal(t, at::full({5}, 3.0f)));
  }, 20s, GroupOptions(), "auto"));
  for (const auto& e : run_shm(2, [](ProcessGroup&) {}, 10s))
    EXPECT_TRUE(Contains(e, "asks for shared memory, which DTRAIN_SHM_DISABLE=1 forbids")) << e;
  ScopedEnv bad("DTRAIN_SHM_DISABLE", "yes");
  for (const auto& e : run_shm(2, [](ProcessGroup&) {}, 10s))
    EXPECT_TRUE(Contains(e, "DTRAIN_SHM_DISABLE='yes' is not an integer")) << e;
}

TEST(Shm, GroupLeavesNoNameInDevShm) {
  expect_no_errors(run_shm(3, [&](ProcessGroup& g) {
    g.barrier()->wait();
    // While the group is alive its segment is already unlinked.
    EXPECT_EQ(own_names(), std::vector<std::string>{});
    g.barrier()->wait();
  }));
  EXPECT_EQ(own_names(), std::vector<std::string>{});
}

}  // namespace
}  // namespace dtrain

namespace dtrain {
namespace {

// Rank 0 played by hand: a slots segment (the shm transport's first, under
// the store's "host0/slots/" keys) whose header declares slots of 1 TiB (before:
// taken as is, and the first collective wrote past the mapping).
TEST(ShmAttach, AHeaderThatDoesNotFitItsSegmentIsRefused) {
  auto store = std::make_shared<HashStore>(std::chrono::seconds(10));
  std::string error;
  std::thread rank1([&] {
    try {
      create_process_group("shm", store, 1, 2);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  store->set("host0/slots/shm/node/0",
             store->get_string("host0/slots/shm/node/1"));  // the same machine
  auto segment = shm::Segment::create(1 << 20);
  struct Header {
    uint64_t magic;
    uint32_t version, size;
    uint64_t half_bytes;
  } header{0x64747261696e7368ULL, 2, 2, uint64_t{1} << 40};
  std::memcpy(segment.data(), &header, sizeof(header));
  store->set("host0/slots/shm/segment", segment.name() + " " + std::to_string(segment.size()));
  rank1.join();
  EXPECT_TRUE(testing::Contains(error, "declares slots of 1099511627776 bytes, which do not fit "
                                       "its 1048576 bytes for 2 ranks"))
      << error;
}

}  // namespace
}  // namespace dtrain
