// Sequence parallelism against one process: a pre-norm MLP block (a
// LayerNorm on sequence shards, a column layer taking and a row layer
// giving the sequence sharded, a residual) over 2 and 4 thread ranks gives each rank
// its sequence shard of the block's output and of the input's gradient,
// the whole gradients of the replicated norm and bias, the shards of the
// split weights' gradients, and after 5 Adam steps the same parameters;
// the region operations move exactly what they say; each block's
// collectives are counted; what a user gets wrong is named.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "dtrain/distributed.h"
#include "dtrain/store/prefix_store.h"
#include "dtrain/tensor_parallel.h"
#include "harness/assertions.h"
#include "harness/flight_counts.h"
#include "harness/shards.h"
#include "harness/temp_dir.h"
#include "harness/thread_ranks.h"
#include "harness/tp_block.h"

namespace dtrain {
namespace {

namespace tp = tensor_parallel;
using testing::expect_close;
using testing::RankContext;
using testing::shard;

constexpr int kSpSteps = 5;
constexpr int64_t kSpSeq = 8, kSpBatch = 2, kSpHidden = 8, kSpInner = 16;

// `dim` is the sequence: inputs are [batch, seq, hidden] (dim 1) or
// [seq, batch, hidden] (dim 0).
void expect_block_equals_one_process(int ranks, int64_t dim) {
  SCOPED_TRACE("ranks " + std::to_string(ranks) + ", sequence_dim " + std::to_string(dim));
  const auto init = testing::initial_block(kSpHidden, kSpInner);
  std::vector<at::Tensor> xs, ys;
  const std::vector<int64_t> sizes =
      dim == 1 ? std::vector<int64_t>{kSpBatch, kSpSeq, kSpHidden} : std::vector<int64_t>{kSpSeq, kSpBatch, kSpHidden};
  for (int step = 0; step < kSpSteps; ++step) {
    xs.push_back(torch::randn(sizes));
    ys.push_back(torch::randn(sizes));
  }
  const auto want = testing::one_process(init, xs, ys, testing::kAdam);
  testing::expect_no_errors(testing::run_rank_contexts(ranks, [&](RankContext& ctx) {
    const int r = ctx.rank;
    testing::TpBlock block(init, testing::block_options(ctx.group, true, dim));
    EXPECT_EQ(tp::mark_sequence_parallel(*block->norm, ctx.group), 0);  // marked once, by the block
    auto adam = testing::kAdam(block->parameters());
    for (int step = 0; step < kSpSteps; ++step) {
      adam->zero_grad();
      auto x = shard(xs[step], dim, r, ranks).clone().requires_grad_(true);
      auto out = block(x);
      // This shard's part of the whole sequence's mean squared error.
      ((out - shard(ys[step], dim, r, ranks)).pow(2).sum() / xs[step].numel()).backward();
      if (step == 0) {
        expect_close(out, shard(want.output, dim, r, ranks), "the block's output");
        expect_close(x.grad(), shard(want.input_grad, dim, r, ranks), "the input's gradient");
        for (const auto& item : block->named_parameters())
          expect_close(item.value().grad(), testing::block_shard(want.grads, item.key(), r, ranks),
                       item.key() + "'s gradient");
      }
      adam->step();
    }
    for (const auto& item : block->named_parameters())
      expect_close(item.value(), testing::block_shard(want.after, item.key(), r, ranks),
                   item.key() + " after 5 Adam steps");
  }));
}

TEST(SequenceParallel, ANormAndMlpBlockEqualsOneProcessAt2And4RanksAlongEitherDimension) {
  expect_block_equals_one_process(2, 1);
  expect_block_equals_one_process(4, 1);
  expect_block_equals_one_process(2, 0);
}

// Exact values: rank r holds r + 1 everywhere; the gradients are ones.
TEST(SequenceParallel, TheRegionsMoveTheSequenceAndTheirGradientsAsDocumented) {
  testing::expect_no_errors(testing::run_rank_contexts(2, [&](RankContext& ctx) {
    const auto& g = ctx.group;
    const double mine = ctx.rank + 1;
    // gather: [1, 2, 3] here, [1, 2, 3] from each rank along dim 1.
    auto part = torch::full({1, 3, 2}, mine).requires_grad_(true);
    auto whole = tp::gather_from_sequence_region(part, g, 1);
    EXPECT_TRUE(at::equal(whole, torch::cat({torch::full({1, 3, 2}, 1.0), torch::full({1, 3, 2}, 2.0)}, 1)));
    whole.sum().backward();
    EXPECT_TRUE(at::equal(part.grad(), torch::full({1, 3, 2}, 2.0)));  // reduce-scattered: 1 + 1
    // reduce_scatter: the sum over ranks of this rank's half of the sequence.
    auto full = torch::full({1, 4, 2}, mine).requires_grad_(true);
    auto summed = tp::reduce_scatter_to_sequence_region(full, g, 1);
    EXPECT_TRUE(at::equal(summed, torch::full({1, 2, 2}, 3.0)));
    (summed * mine).sum().backward();  // each rank's gradient is its rank + 1
    EXPECT_TRUE(at::equal(full.grad(), torch::cat({torch::full({1, 2, 2}, 1.0), torch::full({1, 2, 2}, 2.0)}, 1)));
    // scatter: this rank's rows of dim 0; the gradient gathers back.
    auto seq = torch::arange(8, torch::kDouble).reshape({4, 2}).requires_grad_(true);
    auto slice = tp::scatter_to_sequence_region(seq, g, 0);
    EXPECT_TRUE(at::equal(slice, seq.detach().narrow(0, 2 * ctx.rank, 2)));
    (slice * mine).sum().backward();
    EXPECT_TRUE(at::equal(seq.grad(), torch::cat({torch::full({2, 2}, 1.0, torch::kDouble),
                                                  torch::full({2, 2}, 2.0, torch::kDouble)})));
  }));
}

// The embedding under sequence parallelism: this rank's sequence shard of
// the whole Embedding's output, and its rows of the table's gradient.
TEST(SequenceParallel, VocabParallelEmbeddingGivesThisRanksSequenceShard) {
  torch::manual_seed(6);
  torch::nn::Embedding full(12, 5);
  const auto ids = torch::randint(0, 12, {3, 8}, torch::kLong);  // [batch, seq]
  auto whole = std::dynamic_pointer_cast<torch::nn::EmbeddingImpl>(full->clone());
  const auto want = whole->forward(ids);
  want.pow(2).sum().backward();
  testing::expect_no_errors(testing::run_rank_contexts(4, [&](RankContext& ctx) {
    tp::VocabParallelEmbedding embedding(
        full, tp::ParallelLinearOptions().group(ctx.group).output_layout(tp::Shard(1)));
    auto out = embedding(ids);
    expect_close(out, shard(want, 1, ctx.rank, 4), "its output");
    out.pow(2).sum().backward();
    expect_close(embedding->weight.grad(), shard(whole->weight.grad(), 0, ctx.rank, 4),
                 "its rows of the table's gradient");
  }));
}

// One forward and backward of the block at 2 ranks, and the collectives
// the flight recorder saw, summed over both ranks' groups.
std::map<std::string, size_t> block_collectives(bool sequence_parallel, bool checkpoint) {
  const auto init = testing::initial_block(kSpHidden, kSpInner);
  const auto x0 = torch::randn({kSpBatch, kSpSeq, kSpHidden});
  testing::TempDir dir;
  std::string path;
  testing::expect_no_errors(testing::run_rank_contexts(2, [&](RankContext& ctx) {
    testing::TpBlock block(
        init, testing::block_options(ctx.group, sequence_parallel),
        checkpoint);
    auto x = (sequence_parallel ? shard(x0, 1, ctx.rank, 2) : x0).clone().requires_grad_(true);
    block(x).sum().backward();
    ctx.group->barrier()->wait();
    if (ctx.rank == 0) path = dump_flight_recorder(dir.path());
    ctx.group->barrier()->wait();
  }));
  return testing::tensor_parallel_collectives(path);
}

// Per rank and block: without sequence parallelism one all_reduce forward
// (the row layer's sum) and one backward (the column layer's input
// gradient); with it, an all-gather and a reduce-scatter each way instead,
// and the replicated gradients summed (the norm's weight and bias, the row
// layer's bias); activation checkpointing adds the forward's again.
TEST(SequenceParallel, EachBlocksCollectivesAreCounted) {
  using Ops = std::map<std::string, size_t>;
  const auto twice = [](size_t ar, size_t ag, size_t rs) {
    return Ops{{"all_reduce", 2 * ar}, {"all_gather_into_tensor", 2 * ag}, {"reduce_scatter_tensor", 2 * rs}};
  };
  EXPECT_EQ(block_collectives(false, false), twice(2, 0, 0));
  EXPECT_EQ(block_collectives(true, false), twice(3, 2, 2));
  EXPECT_EQ(block_collectives(false, true), twice(3, 0, 0));
  EXPECT_EQ(block_collectives(true, true), twice(3, 3, 3));
}

TEST(SequenceParallel, LayoutsALayerDoesNotTakeAndSequencesThatDoNotSplitAreNamed) {
  testing::expect_no_errors(testing::run_rank_contexts(4, [&](RankContext& ctx) {
    const auto on = tp::ParallelLinearOptions().group(ctx.group);
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                tp::ColumnParallelLinear(8, 16, tp::ParallelLinearOptions(on).input_layout(tp::Shard(-1)));
              }),
              "ColumnParallelLinear: input layout Shard(-1): it takes Replicate() or Shard(d) with d the "
              "sequence (not the features, -1)");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                tp::ColumnParallelLinear(8, 16, tp::ParallelLinearOptions(on).output_layout(tp::Shard(1)));
              }),
              "ColumnParallelLinear: output layout Shard(1): it takes Replicate() or Shard(-1) (the features)");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                tp::RowParallelLinear(16, 8, tp::ParallelLinearOptions(on).output_layout(tp::Shard(-1)));
              }),
              "RowParallelLinear: output layout Shard(-1): it takes Replicate() or Shard(d) with d the "
              "sequence (not the features, -1)");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                tp::VocabParallelEmbedding(8, 4, tp::ParallelLinearOptions(on).input_layout(tp::Shard(-1)));
              }),
              "VocabParallelEmbedding: input layout Shard(-1): its input, the ids, is whole on every rank "
              "(Replicate())");
    tp::RowParallelLinear row(16, 8, tp::ParallelLinearOptions(on).output_layout(tp::Shard(1)));
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { row(torch::zeros({2, 6, 4})); }),
              "RowParallelLinear: the sequence (dimension 1, 6) does not split over the 4 ranks of "
              "group 'default'");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { row(torch::zeros({6, 4})); }),
              "RowParallelLinear: output layout Shard(1) of a tensor of shape [6, 8] (the last "
              "dimension is the features; Shard(1) must name the sequence)");
    tp::ColumnParallelLinear column(8, 16, tp::ParallelLinearOptions(on).input_layout(tp::Shard(1)));
    const auto x = torch::zeros({2, 4, 8});
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                column->forward_entered(tp::enter_column_region(x, ctx.group, tp::Replicate()));
              }),
              "ColumnParallelLinear: an input entered from Replicate() where this layer's input layout is "
              "Shard(1)");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { column->forward_entered(tp::ColumnInput()); }),
              "ColumnParallelLinear: an input that enter_column_region did not make");
    auto norm = torch::nn::LayerNorm(torch::nn::LayerNormOptions({4}));
    tp::mark_sequence_parallel(*norm, ctx.group);
    auto other = create_process_group("tcp", std::make_shared<PrefixStore>("tp2", ctx.store),
                                      ctx.rank, 4, GroupOptions().name("tp2"));
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                column->forward_entered(tp::enter_column_region(x, other, tp::Shard(1)));
              }),
              "ColumnParallelLinear: an input entered for group 'tp2' where this layer's group is 'default'");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { tp::sum_gradients_together({norm->weight}, ctx.group); }),
              "sum_gradients_together: parameter 0 ([4]) is marked by mark_sequence_parallel too: its "
              "gradient would be summed twice");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { tp::mark_sequence_parallel(*norm, other); }),
              "mark_sequence_parallel: parameter 'weight' is already marked for another group "
              "than 'tp2'");
  }));
}

}  // namespace
}  // namespace dtrain
