// Activation checkpointing against the same model run plainly: the same
// gradients (dropout's mask drawn again), no activation of a segment kept
// in the graph, integer inputs and inputs without gradients, DDP over a
// model that checkpoints its blocks equal to one process, and bad use named.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "dtrain/activation_checkpoint.h"
#include "dtrain/ddp.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "harness/assertions.h"
#include "harness/cpu_autocast.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::CpuAutocast;
using testing::RankContext;

// Blocks, then a head; each block may run as a checkpointed segment. With
// head_in_segment, the head runs inside the last block's segment: the
// backward then starts inside a recomputation.
template <typename Block>
at::Tensor run_blocks(const std::vector<Block>& blocks, torch::nn::Linear head,
                      at::Tensor x, bool checkpoint, bool head_in_segment,
                      const ActivationCheckpointOptions& options = {}) {
  for (size_t i = 0; i < blocks.size(); ++i) {
    const bool with_head = head_in_segment && i + 1 == blocks.size();
    // By value: the segment runs again in the backward, after this loop.
    auto run = [block = blocks[i], head, with_head](at::Tensor h) mutable {
      h = block->forward(h);
      return with_head ? head->forward(h) : h;
    };
    x = checkpoint ? activation_checkpoint(run, x, options) : run(x);
  }
  return head_in_segment ? x : head->forward(x);
}

// Runs `check(head_in_segment)` both ways, naming which.
void with_both_backward_starts(const std::function<void(bool)>& check) {
  for (const bool head_in_segment : {true, false}) {
    SCOPED_TRACE(head_in_segment ? "the backward starts inside a segment"
                                 : "the backward starts outside every segment");
    check(head_in_segment);
  }
}

// Two blocks (Linear, dropout, tanh) and a head; each block may run as a
// checkpointed segment.
struct BlocksImpl : torch::nn::Module {
  BlocksImpl(bool checkpoint, bool preserve_rng = true, double dropout = 0.3)
      : checkpoint(checkpoint), preserve_rng(preserve_rng) {
    for (int i = 0; i < 2; ++i)
      blocks.push_back(register_module("block" + std::to_string(i),
                                       torch::nn::Sequential(torch::nn::Linear(8, 8),
                                                             torch::nn::Dropout(dropout),
                                                             torch::nn::Tanh())));
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  at::Tensor forward(at::Tensor x) {
    return run_blocks(blocks, head, x, checkpoint, head_in_segment,
                      ActivationCheckpointOptions().preserve_rng_state(preserve_rng));
  }
  bool checkpoint, preserve_rng, head_in_segment = false;
  std::vector<torch::nn::Sequential> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Blocks);

// The model's parameters' gradients and the input's after one backward,
// from seed 5 for the weights and seed 9 for the data and dropout.
std::vector<at::Tensor> gradients(Blocks model, bool input_needs_grad) {
  torch::manual_seed(9);
  auto x = torch::randn({4, 8}).requires_grad_(input_needs_grad);
  auto y = torch::randn({4, 3});
  torch::mse_loss(model->forward(x), y).backward();
  std::vector<at::Tensor> out;
  for (const auto& p : model->parameters()) out.push_back(p.grad().clone());
  if (input_needs_grad) out.push_back(x.grad().clone());
  return out;
}

Blocks seeded(bool checkpoint, bool preserve_rng = true) {
  torch::manual_seed(5);
  return Blocks(checkpoint, preserve_rng);
}

TEST(ActivationCheckpoint, GradientsEqualTheSegmentsRunPlainlyWithTheSameDropoutMasks) {
  for (const bool input_needs_grad : {true, false}) {
    SCOPED_TRACE(input_needs_grad ? "input needs grad" : "input needs no grad");
    const auto plain = gradients(seeded(false), input_needs_grad);
    const auto checkpointed = gradients(seeded(true), input_needs_grad);
    ASSERT_EQ(plain.size(), checkpointed.size());
    for (size_t i = 0; i < plain.size(); ++i)
      EXPECT_TRUE(at::allclose(checkpointed[i], plain[i], 1e-6, 1e-7)) << "gradient #" << i;
    // Without the generators put back, the recomputation draws other
    // masks: the gradients differ (what the option is for).
    const auto redrawn = gradients(seeded(true, /*preserve_rng=*/false), input_needs_grad);
    EXPECT_FALSE(at::allclose(redrawn[0], plain[0], 1e-6, 1e-7));
  }
}

TEST(ActivationCheckpoint, TheBackwardLeavesTheRandomNumberGeneratorAsItFoundIt) {
  auto model = seeded(true);
  torch::manual_seed(11);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  auto out = model->forward(x);
  const auto before = torch::randn({16});  // drawn after the forward
  torch::manual_seed(11);
  auto x2 = torch::randn({4, 8}, torch::requires_grad());
  auto out2 = model->forward(x2);
  out2.sum().backward();
  EXPECT_TRUE(at::equal(torch::randn({16}), before));
}

// The forward under autocast, the loss and backward outside it, as a
// training loop runs them: the recomputation runs under the forward's
// autocast (torch.utils.checkpoint's rule), so every gradient equals the
// segments' run plainly, bitwise, over 3 SGD steps. Before, it ran in
// float32 (gradient #0 off by about 1e-3). And the parameters' bfloat16
// casts it cached are let go: kept, the next step's forward would use
// them after SGD changed the parameters.
TEST(ActivationCheckpoint, TheRecomputationRunsUnderTheForwardsAutocast) {
  std::vector<std::vector<at::Tensor>> got[2];
  for (const bool checkpoint : {false, true}) {
    auto model = seeded(checkpoint);
    torch::optim::SGD sgd(model->parameters(), 0.5);
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(9 + step);
      const auto x = torch::randn({4, 8}), y = torch::randn({4, 3});
      sgd.zero_grad();
      at::Tensor out;
      {
        CpuAutocast autocast;
        out = model->forward(x);
      }
      ASSERT_EQ(out.scalar_type(), at::kBFloat16) << "autocast did not run the model in bfloat16";
      torch::mse_loss(out.to(at::kFloat), y).backward();
      std::vector<at::Tensor> grads;
      for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
      got[checkpoint].push_back(grads);
      sgd.step();
    }
  }
  for (size_t step = 0; step < got[0].size(); ++step)
    for (size_t i = 0; i < got[0][step].size(); ++i)
      EXPECT_TRUE(at::equal(got[1][step][i], got[0][step][i]))
          << "step " << step << ", gradient #" << i << ": off by "
          << (got[1][step][i] - got[0][step][i]).abs().max().item<double>();
}

TEST(ActivationCheckpoint, TheGraphHoldsOnlyTheSegmentsInput) {
  torch::manual_seed(5);
  torch::nn::Linear a(8, 8), b(8, 8);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  auto y = activation_checkpoint([&](at::Tensor h) { return b(torch::tanh(a(h))); }, x);
  ASSERT_TRUE(y.grad_fn());
  // One node for the whole segment: its edges lead to the input's
  // accumulator and the anchor, none into the segment's own operations.
  const auto& edges = y.grad_fn()->next_edges();
  ASSERT_EQ(edges.size(), 2u);
  EXPECT_EQ(edges[0].function, torch::autograd::impl::gradient_edge(x).function);
  EXPECT_EQ(edges[0].function->name(), std::string("torch::autograd::AccumulateGrad"));
  EXPECT_EQ(edges[1].function->name(), std::string("torch::autograd::AccumulateGrad"));
}

TEST(ActivationCheckpoint, AnIntegerInputStillGivesTheParametersTheirGradients) {
  torch::manual_seed(5);
  torch::nn::Embedding table(10, 4);
  const auto ids = torch::tensor({1, 3, 3, 7});
  torch::mse_loss(table(ids), torch::ones({4, 4})).backward();
  const auto plain = table->weight.grad().clone();
  table->weight.mutable_grad().reset();
  torch::mse_loss(activation_checkpoint([&](at::Tensor i) { return table(i); }, ids),
                  torch::ones({4, 4}))
      .backward();
  EXPECT_TRUE(at::allclose(table->weight.grad(), plain));
}

TEST(ActivationCheckpoint, WithoutGradientsTheSegmentSimplyRuns) {
  torch::NoGradGuard no_grad;
  int runs = 0;
  auto y = activation_checkpoint([&](at::Tensor h) { ++runs; return h * 2; }, torch::ones({2}));
  EXPECT_EQ(runs, 1);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(at::equal(y, torch::full({2}, 2.0)));
}

TEST(ActivationCheckpoint, BadUseIsNamed) {
  EXPECT_TRUE(testing::Contains(
      testing::what_thrown<InvalidArgument>([] { activation_checkpoint(nullptr, torch::ones({2})); }),
      "activation_checkpoint: no segment to run"));
  auto x = torch::ones({2}, torch::requires_grad());
  EXPECT_TRUE(testing::Contains(
      testing::what_thrown<InvalidArgument>(
          [&] { activation_checkpoint([](at::Tensor) { return at::Tensor(); }, x); }),
      "activation_checkpoint: the segment returned no tensor in the forward"));
  // A segment that computes something else the second time.
  int runs = 0;
  auto y = activation_checkpoint(
      [&](at::Tensor h) { return ++runs == 1 ? h * 2 : torch::cat({h, h}); }, x);
  // The engine may wrap what a backward function throws: the text is ours.
  EXPECT_TRUE(testing::Contains(testing::what_thrown<InvalidArgument>([&] { y.sum().backward(); }),
                                "activation_checkpoint: the segment returned [4] when recomputed "
                                "in the backward but [2] in the forward"));
}

// DDP over 2 ranks whose model checkpoints its blocks: every gradient
// equals one process on the whole batch, before and after DDP rebuilt its
// buckets (no dropout: the ranks would draw their own masks).
void expect_ddp_equals_one_process(bool head_in_segment) {
  constexpr int kWorld = 2, kBatch = 4;
  torch::manual_seed(9);
  const auto x = torch::randn({kWorld * kBatch, 8}), y = torch::randn({kWorld * kBatch, 3});
  auto reference = seeded(false);
  reference->eval();
  torch::mse_loss(reference->forward(x), y).backward();
  std::vector<Blocks> models;
  for (int r = 0; r < kWorld; ++r) {
    models.push_back(seeded(true));
    models.back()->head_in_segment = head_in_segment;
    models.back()->eval();
  }
  testing::expect_no_errors(testing::run_rank_contexts(kWorld, [&](RankContext& ctx) {
    DistributedDataParallel ddp(models[ctx.rank], DDPOptions().process_group(ctx.group));
    for (int step = 0; step < 2; ++step) {
      for (auto& p : ddp.parameters()) p.mutable_grad().reset();
      torch::mse_loss(ddp.forward(x.narrow(0, ctx.rank * kBatch, kBatch)),
                      y.narrow(0, ctx.rank * kBatch, kBatch))
          .backward();
      const auto want = reference->parameters();
      const auto got = models[ctx.rank]->parameters();
      for (size_t i = 0; i < want.size(); ++i)
        EXPECT_TRUE(at::allclose(got[i].grad(), want[i].grad(), 1e-5, 1e-6))
            << "rank " << ctx.rank << " step " << step << " gradient #" << i;
    }
  }, 60s));
}

// DDP's reduction is queued by the first gradient that is ready. With the
// head inside the last segment, that is one of the segment's parameters,
// inside a recomputation's own backward; the reduction must still wait for
// the enclosing backward, which has the first block to do (without
// end_of_backward.h it ran when the inner backward ended, and failed).
TEST(ActivationCheckpoint, DdpOverCheckpointedBlocksEqualsOneProcess) {
  with_both_backward_starts(expect_ddp_equals_one_process);
}

struct ShardBlockImpl : torch::nn::Module {
  ShardBlockImpl() { fc = register_module("fc", torch::nn::Linear(8, 8)); }
  at::Tensor forward(at::Tensor x) { return torch::tanh(fc(x)); }
  torch::nn::Linear fc{nullptr};
};

// Two FSDP units and a head (in the root unit); the units may run as
// checkpointed segments.
struct ShardNetImpl : torch::nn::Module {
  explicit ShardNetImpl(bool checkpoint) : checkpoint(checkpoint) {
    for (int i = 0; i < 2; ++i)
      blocks.push_back(register_module("block" + std::to_string(i),
                                       std::make_shared<FullyShard<ShardBlockImpl>>()));
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  at::Tensor forward(at::Tensor x) {
    return run_blocks(blocks, head, x, checkpoint, head_in_segment);
  }
  bool checkpoint, head_in_segment = false;
  std::vector<std::shared_ptr<FullyShard<ShardBlockImpl>>> blocks;
  torch::nn::Linear head{nullptr};
};

// FSDP gathers a unit's parameters again for its recomputation: every
// shard's gradient equals that of the same FSDP model run plainly.
void expect_fsdp_segments_equal_plain(bool head_in_segment) {
  constexpr int kWorld = 2, kBatch = 4;
  torch::manual_seed(9);
  const auto x = torch::randn({kWorld * kBatch, 8}), y = torch::randn({kWorld * kBatch, 3});
  std::vector<std::shared_ptr<ShardNetImpl>> plain, checkpointed;
  for (int r = 0; r < kWorld; ++r) {
    torch::manual_seed(5);
    plain.push_back(std::make_shared<ShardNetImpl>(false));
    torch::manual_seed(5);
    checkpointed.push_back(std::make_shared<ShardNetImpl>(true));
    plain.back()->head_in_segment = checkpointed.back()->head_in_segment = head_in_segment;
  }
  testing::expect_no_errors(testing::run_rank_contexts(kWorld, [&](RankContext& ctx) {
    const int r = ctx.rank;
    FullyShardedDataParallel a(plain[r], FSDPOptions().process_group(ctx.group));
    FullyShardedDataParallel b(checkpointed[r], FSDPOptions().process_group(ctx.group));
    for (int step = 0; step < 2; ++step) {
      const auto xr = x.narrow(0, r * kBatch, kBatch), yr = y.narrow(0, r * kBatch, kBatch);
      for (auto& p : a.parameters()) p.mutable_grad().reset();
      for (auto& p : b.parameters()) p.mutable_grad().reset();
      torch::mse_loss(a.forward(xr), yr).backward();
      torch::mse_loss(b.forward(xr), yr).backward();
      const auto want = a.parameters(), got = b.parameters();
      ASSERT_EQ(want.size(), got.size());
      for (size_t i = 0; i < want.size(); ++i)
        EXPECT_TRUE(at::allclose(got[i].grad(), want[i].grad(), 1e-5, 1e-6))
            << "rank " << r << " step " << step << " shard #" << i;
    }
  }, 60s));
}

// As with DDP, FSDP's end of backward (its last reduce-scatters) must wait
// for the enclosing backward when the backward starts inside a segment.
TEST(ActivationCheckpoint, FsdpUnitsRunAsSegmentsGiveThePlainShardsGradients) {
  with_both_backward_starts(expect_fsdp_segments_equal_plain);
}

}  // namespace
}  // namespace dtrain
