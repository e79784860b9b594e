// The tensor-parallel random streams (tensor_parallel_rng.h): a ForkRng
// draws this rank's stream (seed + 2718 + rank) and leaves the default
// generator as it found it; the stream continues where it stopped; an
// activation-checkpointed segment that forks draws the same masks when
// recomputed; bad use is named.
//
// The default generator is one per process and the thread ranks share it:
// each rank's seeding and drawing runs under one lock.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "dtrain/activation_checkpoint.h"
#include "dtrain/errors.h"
#include "dtrain/tensor_parallel_rng.h"
#include "harness/assertions.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

namespace tp = tensor_parallel;

at::Tensor draw(uint64_t seed, int64_t n, int skip = 0) {
  auto gen = at::detail::createCPUGenerator(seed);
  for (int i = 0; i < skip; ++i) at::rand({n}, gen);
  return at::rand({n}, gen);
}

// First in this file: the process has no stream before manual_seed.
TEST(TensorParallelRng, AForkBeforeAnySeedIsNamed) {
  try {
    tp::ForkRng fork;
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(testing::Contains(e.what(), "no tensor-parallel stream for cpu"));
    EXPECT_TRUE(testing::Contains(e.what(), "tensor_parallel::manual_seed"));
  }
}

TEST(TensorParallelRng, AForkDrawsThisRanksStreamAndLeavesTheDefaultOneAlone) {
  std::mutex one_at_a_time;
  testing::expect_no_errors(testing::run_ranks(2, [&](ProcessGroup& g) {
    std::lock_guard<std::mutex> lock(one_at_a_time);
    auto group = std::shared_ptr<ProcessGroup>(&g, [](ProcessGroup*) {});
    tp::manual_seed(7, group);
    at::Tensor first, mine, second, mine_again;
    first = at::rand({5});
    {
      tp::ForkRng fork;
      mine = at::rand({5});
    }
    second = at::rand({5});
    {
      tp::ForkRng fork;
      mine_again = at::rand({5});
    }
    EXPECT_TRUE(first.equal(draw(7, 5))) << "the default generator has the seed itself";
    EXPECT_TRUE(second.equal(draw(7, 5, 1))) << "forking did not move the default generator";
    EXPECT_TRUE(mine.equal(draw(7 + 2718 + g.rank(), 5))) << "rank " << g.rank();
    EXPECT_TRUE(mine_again.equal(draw(7 + 2718 + g.rank(), 5, 1))) << "the stream went on where it was";
  }));
}

// Linear, dropout in this rank's stream, tanh, dropout in the default one.
at::Tensor forked_segment(torch::nn::Linear lin, const at::Tensor& x) {
  at::Tensor h = lin->forward(x);
  {
    tp::ForkRng own;
    h = torch::dropout(h, 0.5, true);
  }
  return torch::dropout(torch::tanh(h), 0.3, true);
}

TEST(TensorParallelRng, ACheckpointedSegmentThatForksDrawsTheSameMasksAgain) {
  testing::expect_no_errors(testing::run_ranks(1, [&](ProcessGroup& g) {
    auto group = std::shared_ptr<ProcessGroup>(&g, [](ProcessGroup*) {});
    at::Tensor grads[2], after[2];
    for (const bool checkpoint : {false, true}) {
      torch::manual_seed(3);
      torch::nn::Linear lin(16, 16);
      const auto x = torch::randn({8, 16}).requires_grad_(true);
      tp::manual_seed(11, group);
      auto segment = [lin](at::Tensor in) { return forked_segment(lin, in); };
      const auto out = checkpoint ? activation_checkpoint(segment, x) : segment(x);
      out.pow(2).sum().backward();
      grads[checkpoint] = torch::cat({lin->weight.grad().flatten(), x.grad().flatten()});
      tp::ForkRng fork;
      after[checkpoint] = at::rand({4});  // where the stream stands after the backward
    }
    EXPECT_TRUE(grads[1].equal(grads[0])) << "the recomputation drew other masks";
    EXPECT_TRUE(after[1].equal(after[0])) << "the backward moved this rank's stream";
  }));
}

TEST(TensorParallelRng, BadUseIsNamed) {
  testing::expect_no_errors(testing::run_ranks(1, [&](ProcessGroup& g) {
    auto group = std::shared_ptr<ProcessGroup>(&g, [](ProcessGroup*) {});
    tp::manual_seed(1, group);
    {
      tp::ForkRng fork;
      try {
        tp::ForkRng again;
        ADD_FAILURE() << "nested fork: no error";
      } catch (const InvalidArgument& e) {
        EXPECT_TRUE(testing::Contains(e.what(), "ForkRng: one for cpu is alive already"));
      }
      EXPECT_THROW(tp::manual_seed(2, group), InvalidArgument);
    }
    try {
      tp::manual_seed(1, group, c10::Device(c10::kCUDA));
      ADD_FAILURE() << "a CUDA device without an index: no error";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "device cuda (the CPU, or a CUDA device with its index)"));
    }
  }));
}

}  // namespace
}  // namespace dtrain
