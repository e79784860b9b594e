// Which algorithm each collective takes (algorithms/select.cpp) and the
// two-level ones across stand-in hosts: every choice exact, a mismatch or a
// missing rank inside one host failing every host.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <thread>

#include "common/enforce.h"
#include "harness/assertions.h"
#include "harness/exact_values.h"
#include "harness/scoped_env.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using testing::expect_equal;
using testing::expect_no_errors;
using testing::expected_reduction;
using testing::input;

// DTRAIN_ALGO forces all_reduce's algorithm where it can run: each, at every
// size (the two levels and the ring below 64 KiB too, where auto would take
// recursive doubling), on tcp and on auto over two stand-in hosts of two
// ranks, is exact.
TEST(AllReduceAlgo, EachForcedAlgorithmIsExact) {
  for (const char *algo : {"ring", "recursive_doubling", "two_level"}) {
    testing::ScopedEnv forced("DTRAIN_ALGO", algo);
    for (const auto &[backend, world] :
         {std::pair<std::string, int>{"tcp", 3}, {"auto@2", 4}}) {
      expect_no_errors(testing::run_ranks(
          world,
          [&](ProcessGroup &g) {
            for (int64_t n : {1, 5, 1031, 300000}) {
              auto t = input(g.rank(), n, at::kFloat);
              g.all_reduce(t)->wait();
              expect_equal(
                  t, expected_reduction(world, n, at::kFloat, ReduceOp::SUM),
                  detail::cat("DTRAIN_ALGO=", algo, " on ", backend, " n=", n));
            }
          },
          std::chrono::seconds(30), GroupOptions(), backend));
    }
  }
}

// all_gather and reduce_scatter over several hosts take two levels above
// 64 KiB (two_level.cpp): exact for 2 hosts of 2 and of 3 ranks and 3 hosts
// of 2, below and above that size, list and flat forms, a float sum and an
// integer max; and the same with DTRAIN_ALGO=ring (flat).
TEST(TwoLevel, AllGatherAndReduceScatterOverHostsAreExact) {
  for (const char *algo : {"auto", "ring"}) {
    testing::ScopedEnv forced("DTRAIN_ALGO", algo);
    for (const auto &[backend, world] :
         {std::pair<std::string, int>{"auto@2", 4},
          {"auto@2", 6},
          {"auto@3", 6}}) {
      const int W = world;
      const std::vector<int64_t> sizes = {1, 4099, 70001};
      // What every rank expects, computed once before the ranks start.
      std::vector<at::Tensor> gathered, sums, maxes;
      for (int64_t n : sizes) {
        std::vector<at::Tensor> rows;
        for (int r = 0; r < W; ++r)
          rows.push_back(input(r, n, at::kFloat));
        gathered.push_back(at::cat(rows));
        sums.push_back(expected_reduction(W, n * W, at::kFloat, ReduceOp::SUM));
        maxes.push_back(expected_reduction(W, n * W, at::kLong, ReduceOp::MAX));
      }
      expect_no_errors(testing::run_ranks(
          W,
          [&](ProcessGroup &g) {
            const auto what = [&](const char *op, int64_t n) {
              return detail::cat(op, " on ", backend, " world ", W, " n=", n,
                                 " DTRAIN_ALGO=", algo, " rank ", g.rank());
            };
            for (size_t k = 0; k < sizes.size(); ++k) {
              const int64_t n = sizes[k];
              auto flat = at::zeros({n * W});
              g.all_gather_into_tensor(flat, input(g.rank(), n, at::kFloat))
                  ->wait();
              expect_equal(flat, gathered[k],
                           what("all_gather_into_tensor", n));
              std::vector<at::Tensor> outs;
              for (int r = 0; r < W; ++r)
                outs.push_back(at::zeros({n}));
              g.all_gather(outs, input(g.rank(), n, at::kFloat))->wait();
              expect_equal(at::cat(outs), gathered[k], what("all_gather", n));

              auto out = at::zeros({n});
              g.reduce_scatter_tensor(out, input(g.rank(), n * W, at::kFloat))
                  ->wait();
              expect_equal(out, sums[k].narrow(0, g.rank() * n, n),
                           what("reduce_scatter_tensor", n));
              auto full = input(g.rank(), n * W, at::kLong);
              auto chunks = full.chunk(W);
              auto out_long = at::zeros({n}, at::kLong);
              g.reduce_scatter(
                   out_long,
                   std::vector<at::Tensor>(chunks.begin(), chunks.end()),
                   ReduceOp::MAX)
                  ->wait();
              expect_equal(out_long, maxes[k].narrow(0, g.rank() * n, n),
                           what("reduce_scatter MAX", n));
            }
          },
          std::chrono::seconds(60), GroupOptions(), backend));
    }
  }
}

// From 8 MiB the two-level all_reduce runs in chunks, the network phase of
// one beside the phases inside the host of the others: exact in every
// chunk, the last one shorter, with 2 and 4 chunks (float) and 4 and 8
// (int64), for a float sum and an integer max, on 2 hosts of 2 and of 3
// ranks and 3 hosts of 2.
TEST(TwoLevel, PipelinedAllReduceIsExactInEveryChunk) {
  for (const auto &[backend, world] : {std::pair<std::string, int>{"auto@2", 4},
                                       {"auto@2", 6},
                                       {"auto@3", 6}}) {
    const int W = world;
    const std::vector<int64_t> sizes = {2500007, 4500007};
    // The expected results once, before the ranks start, not once per rank:
    // computing them was most of this test's time on 2 cores.
    std::vector<at::Tensor> float_sums, long_maxes;
    for (int64_t n : sizes) {
      float_sums.push_back(expected_reduction(W, n, at::kFloat, ReduceOp::SUM));
      long_maxes.push_back(expected_reduction(W, n, at::kLong, ReduceOp::MAX));
    }
    expect_no_errors(testing::run_ranks(
        W,
        [&](ProcessGroup &g) {
          for (size_t k = 0; k < sizes.size(); ++k) {
            const int64_t n = sizes[k];
            auto t = input(g.rank(), n, at::kFloat);
            g.all_reduce(t)->wait();
            expect_equal(
                t, float_sums[k],
                detail::cat("float SUM on ", backend, " world ", W, " n=", n));
            auto l = input(g.rank(), n, at::kLong);
            g.all_reduce(l, ReduceOp::MAX)->wait();
            expect_equal(
                l, long_maxes[k],
                detail::cat("long MAX on ", backend, " world ", W, " n=", n));
          }
        },
        std::chrono::seconds(90), GroupOptions(), backend));
  }
}

// The two-level phases inside a host run in its slots, whose check catches
// ranks of one host that called different sizes. Only that host sees it;
// the other host's ranks wait for its network phase. So the mismatch
// breaks the group (a CollectiveMismatch on the host that saw it, which
// stays the group's error), and the other host hears of it at once (a
// NetworkError, not its 30 s timeout). On its own, a slots mismatch would
// leave the group usable, and the other host would wait out the timeout.
TEST(TwoLevel, AMismatchInsideOneHostBreaksTheGroupOnEveryHost) {
  const auto errors = testing::run_ranks(
      4,
      [&](ProcessGroup &g) {
        auto t =
            at::ones({g.rank() == 1 ? 100001 : 100000}); // ranks 0, 1: one host
        const auto start = std::chrono::steady_clock::now();
        try {
          g.all_reduce(t)->wait();
          ADD_FAILURE() << "rank " << g.rank()
                        << ": a mismatched all_reduce succeeded";
        } catch (const CollectiveMismatch &e) {
          EXPECT_LT(g.rank(), 2) << e.what();
          EXPECT_TRUE(
              testing::Contains(e.what(), "ranks called different collectives"))
              << e.what();
        } catch (const NetworkError &e) {
          EXPECT_GE(g.rank(), 2) << e.what();
        }
        EXPECT_LT(std::chrono::steady_clock::now() - start,
                  std::chrono::seconds(20));
        auto u = at::ones({4});
        try {
          g.all_reduce(u)->wait();
          ADD_FAILURE() << "rank " << g.rank() << ": the group stayed usable";
        } catch (const Error &e) {
          EXPECT_TRUE(testing::Contains(e.what(), "broken")) << e.what();
        }
      },
      std::chrono::seconds(60),
      GroupOptions().timeout(std::chrono::seconds(30)), "auto@2");
  expect_no_errors(errors);
}

// A rank that never reaches a pipelined all_reduce: every other rank fails
// by the call's timeout, whichever phase was waiting.
TEST(TwoLevel, APipelinedAllReduceFailsByItsTimeoutWhenARankIsMissing) {
  const auto timeout = std::chrono::milliseconds(1500);
  std::vector<double> seconds(4, 0.0);
  const auto errors = testing::run_ranks(
      4,
      [&](ProcessGroup &g) {
        if (g.rank() == 3) {
          std::this_thread::sleep_for(std::chrono::seconds(4));
          return;
        }
        auto t = at::ones({3 << 20}); // 12 MiB: 3 chunks
        const auto start = std::chrono::steady_clock::now();
        try {
          g.all_reduce(t, ReduceOp::SUM, timeout)->wait();
        } catch (const Error &) {
          seconds[g.rank()] = std::chrono::duration<double>(
                                  std::chrono::steady_clock::now() - start)
                                  .count();
          throw;
        }
      },
      std::chrono::seconds(30), GroupOptions(), "auto@2");
  for (int r = 0; r < 3; ++r) {
    EXPECT_FALSE(errors[r].empty())
        << "rank " << r << " finished an all_reduce without rank 3";
    EXPECT_LT(seconds[r], 4.0) << "rank " << r << ": " << errors[r];
  }
}

TEST(AllReduceAlgo, AnUnknownValueIsRefusedNamingTheVariable) {
  testing::ScopedEnv forced("DTRAIN_ALGO", "tree");
  const auto errors = testing::run_ranks(
      2, [](ProcessGroup &) {}, std::chrono::seconds(10));
  for (const auto &e : errors)
    EXPECT_TRUE(testing::Contains(
        e, "environment variable DTRAIN_ALGO='tree' is not valid "
           "(expected auto, ring, recursive_doubling or two_level)"))
        << e;
}

} // namespace
} // namespace dtrain
