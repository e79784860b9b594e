// Training on CUDA tensors (DDP, FSDP, HSDP, ZeRO-1/2, SyncBatchNorm, the
// five pipeline schedules) as users
// run it: dtrain-run starts the ranks as processes, each trains with its
// tensors on the GPU, and every rank ends at the parameters of one process
// on the whole batch.
//
// Two ranks on one GPU go through auto's host staging (NCCL takes one GPU
// per rank); one rank goes through nccl. Processes, not threads: a process
// runs the backward passes of every thread on one GPU in one autograd
// thread, so thread ranks that wait for each other inside backward (DDP,
// FSDP) would wait for ever.
//
// The "_cpu" cases run the same worker modes on the CPU everywhere, so that
// CI checks the modes themselves. The GPU ones are skipped on a machine
// without a GPU (the development machines and CI); the
// GPU issue runs them on a lent GPU machine.

#include <gtest/gtest.h>

#include <cctype>
#include <cstdlib>
#include <string>
#include <tuple>

#include "harness/process_ranks.h"

namespace dtrain::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const std::string kWorker = DTRAIN_TEST_WORKER;

// How many GPUs libtorch sees, asked of a worker (this test links no
// torch); -1 when the worker could not say.
int visible_gpus() {
  static const int count = [] {
    ProcessRanks procs;
    auto& p = procs.spawn({kWorker, "cuda-devices"}, {});
    if (!procs.wait(p, Clock::now() + 60s) || p.exit_code != 0) return -1;
    // libtorch may print warnings first: read the line the worker writes.
    const std::string out = p.output(), said = "cuda devices: ";
    const auto at = out.find(said);
    // A count in digits, or -1: anything else (a count written as a
    // character, as once on libtorch 2.x) fails the tests instead of
    // reading as 0 and skipping them.
    if (at == std::string::npos) return -1;
    const char* digits = out.c_str() + at + said.size();
    return std::isdigit(static_cast<unsigned char>(*digits)) ? std::atoi(digits) : -1;
  }();
  return count;
}

// (worker mode, ranks, backend, what the group must say of CUDA tensors;
// empty: the same run with tensors on the CPU, which runs everywhere and
// checks the worker mode itself)
using Case = std::tuple<std::string, int, std::string, std::string>;
class CudaLaunched : public ::testing::TestWithParam<Case> {};

TEST_P(CudaLaunched, RanksMatchOneProcessOnTheWholeBatch) {
  const auto& [mode, ranks, backend, path] = GetParam();
  const bool cuda = !path.empty();
  ASSERT_GE(visible_gpus(), 0) << "rank_worker cuda-devices failed or wrote no count in digits";
  if (cuda && visible_gpus() == 0) GTEST_SKIP() << "no GPU is visible to libtorch";
  ProcessRanks procs;
  auto& run = procs.spawn({DTRAIN_RUN_EXECUTABLE, "--nproc-per-node", std::to_string(ranks),
                           "--master-port", std::to_string(free_port()), kWorker, mode, backend,
                           cuda ? "cuda" : "cpu"},
                          {});
  ASSERT_TRUE(procs.wait(run, Clock::now() + 180s)) << "dtrain-run did not finish: " << run.output();
  EXPECT_EQ(run.exit_code, 0) << run.output();
  for (int r = 0; r < ranks; ++r) {
    const std::string line = "rank " + std::to_string(r) + " ";
    const auto at = run.output().find(line);
    ASSERT_NE(at, std::string::npos) << run.output();
    const std::string said = run.output().substr(at, run.output().find('\n', at) - at);
    EXPECT_NE(said.find("matches single-process training on"), std::string::npos) << run.output();
    EXPECT_NE(said.find(cuda ? "with tensors on cuda:0" : "with tensors on cpu"), std::string::npos) << said;
    EXPECT_NE(said.find(path), std::string::npos) << said;
  }
}

const std::string kStaged = "CUDA tensors: staged through host memory";
INSTANTIATE_TEST_SUITE_P(
    Gpu, CudaLaunched,
    ::testing::Values(Case{"ddp-equivalence", 2, "auto", kStaged},
                      Case{"fsdp-equivalence", 2, "auto", kStaged},
                      Case{"zero1-equivalence", 2, "auto", kStaged},
                      Case{"zero2-equivalence", 2, "auto", kStaged},
                      Case{"syncbn-equivalence", 2, "auto", kStaged},
                      Case{"syncbn-equivalence", 2, "auto", ""},
                      Case{"hsdp-equivalence", 4, "auto", kStaged},
                      Case{"hsdp-equivalence", 4, "auto", ""},
                      Case{"pipeline-gpipe", 2, "auto", kStaged},
                      Case{"pipeline-1f1b", 2, "auto", kStaged},
                      Case{"pipeline-interleaved", 2, "auto", kStaged},
                      Case{"pipeline-looped-bfs", 2, "auto", kStaged},
                      Case{"pipeline-zbv", 2, "auto", kStaged},
                      Case{"tp-equivalence", 2, "auto", kStaged},
                      Case{"tp-equivalence", 2, "auto", ""},
                      Case{"ep-equivalence", 2, "auto", kStaged},
                      Case{"ep-equivalence", 4, "auto", ""},
                      Case{"diloco-equivalence", 2, "auto", kStaged},
                      Case{"diloco-equivalence", 2, "auto", ""},
                      Case{"pipeline-1f1b", 2, "auto", ""},
                      Case{"pipeline-interleaved", 2, "auto", ""},
                      Case{"pipeline-zbv", 2, "auto", ""},
                      Case{"ddp-equivalence", 1, "auto", "CUDA tensors: nccl"},
                      Case{"fsdp-equivalence", 1, "nccl", "nccl"},
                      Case{"zero2-equivalence", 1, "nccl", "nccl"}),
    [](const auto& info) {
      auto name = std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) + "_" +
                  std::get<2>(info.param) + (std::get<3>(info.param).empty() ? "_cpu" : "");
      for (auto& c : name)
        if (c == '-') c = '_';
      return name;
    });

}  // namespace
}  // namespace dtrain::testing
