// Tensor parallelism against one process: a column-parallel Linear, an
// elementwise function and a row-parallel Linear over 2 and 4 thread ranks
// give the outputs, gradient shards and (after 5 Adam steps) parameter
// shards of the same layers in one process; so do the vocabulary-parallel
// embedding and cross-entropy; what a user gets wrong is named.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>
#include <string>
#include <vector>

#include "dtrain/tensor_parallel.h"
#include "harness/assertions.h"
#include "harness/shards.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

namespace tp = tensor_parallel;
using namespace std::chrono_literals;
using testing::copy_of;
using testing::expect_close;
using testing::RankContext;
using testing::shard;

constexpr int kTpSteps = 5;

// up: Linear(8, 16), tanh, down: Linear(16, 8); Adam; the first step's
// output and gradients, and the parameters after kTpSteps steps.
struct OneProcess {
  at::Tensor output, up_grad, up_bias_grad, down_grad, down_bias_grad, input_grad;
  torch::nn::Linear up, down;
};

OneProcess one_process(const torch::nn::Linear& up0, const torch::nn::Linear& down0,
                       const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& ys) {
  OneProcess p{{}, {}, {}, {}, {}, {}, copy_of(up0), copy_of(down0)};
  std::vector<at::Tensor> params = p.up->parameters();
  for (const auto& q : p.down->parameters()) params.push_back(q);
  torch::optim::Adam adam(params, torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < kTpSteps; ++step) {
    adam.zero_grad();
    auto x = xs[step].clone().requires_grad_(true);
    auto out = p.down(torch::tanh(p.up(x)));
    torch::mse_loss(out, ys[step]).backward();
    if (step == 0) {
      p.output = out.detach().clone();
      p.up_grad = p.up->weight.grad().clone();
      p.up_bias_grad = p.up->bias.grad().clone();
      p.down_grad = p.down->weight.grad().clone();
      p.down_bias_grad = p.down->bias.grad().clone();
      p.input_grad = x.grad().clone();
    }
    adam.step();
  }
  return p;
}

void expect_column_row_equal_one_process(int ranks) {
  SCOPED_TRACE("tensor-parallel ranks: " + std::to_string(ranks));
  torch::manual_seed(3);
  torch::nn::Linear up0(8, 16), down0(16, 8);
  std::vector<at::Tensor> xs, ys;
  for (int step = 0; step < kTpSteps; ++step) {
    xs.push_back(torch::randn({6, 8}));
    ys.push_back(torch::randn({6, 8}));
  }
  const auto want = one_process(up0, down0, xs, ys);
  testing::expect_no_errors(testing::run_rank_contexts(ranks, [&](RankContext& ctx) {
    const int r = ctx.rank;
    const auto options = tp::ParallelLinearOptions().group(ctx.group);
    tp::ColumnParallelLinear up(up0, options);
    tp::RowParallelLinear down(down0, options);
    EXPECT_EQ(up->weight.sizes(), (std::vector<int64_t>{16 / ranks, 8}));
    EXPECT_EQ(down->weight.sizes(), (std::vector<int64_t>{8, 16 / ranks}));
    std::vector<at::Tensor> params = up->parameters();
    for (const auto& q : down->parameters()) params.push_back(q);
    torch::optim::Adam adam(params, torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < kTpSteps; ++step) {
      adam.zero_grad();
      auto x = xs[step].clone().requires_grad_(true);
      auto out = down(torch::tanh(up(x)));
      torch::mse_loss(out, ys[step]).backward();
      if (step == 0) {
        expect_close(out, want.output, "output");
        expect_close(up->weight.grad(), shard(want.up_grad, 0, r, ranks), "up.weight's gradient");
        expect_close(up->bias.grad(), shard(want.up_bias_grad, 0, r, ranks), "up.bias's gradient");
        expect_close(down->weight.grad(), shard(want.down_grad, 1, r, ranks), "down.weight's gradient");
        expect_close(down->bias.grad(), want.down_bias_grad, "down.bias's gradient");
        expect_close(x.grad(), want.input_grad, "the input's gradient");
      }
      adam.step();
    }
    expect_close(up->weight, shard(want.up->weight, 0, r, ranks), "up.weight after 5 steps");
    expect_close(up->bias, shard(want.up->bias, 0, r, ranks), "up.bias after 5 steps");
    expect_close(down->weight, shard(want.down->weight, 1, r, ranks), "down.weight after 5 steps");
    expect_close(down->bias, want.down->bias, "down.bias after 5 steps");
  }));
}

TEST(TensorParallel, ColumnThenRowEqualsOneProcessAt2And4Ranks) {
  expect_column_row_equal_one_process(2);
  expect_column_row_equal_one_process(4);
}

// A column layer whose output is Replicate() (its features gathered), and
// a row layer whose input is Replicate() (sliced by it): each equals the
// whole Linear, output and input gradient.
TEST(TensorParallel, GatheredOutputsAndWholeInputsEqualTheWholeLayer) {
  torch::manual_seed(4);
  torch::nn::Linear full(12, 8);
  const auto x = torch::randn({5, 12});
  auto whole_x = x.clone().requires_grad_(true);
  const auto want = full(whole_x);
  want.pow(2).sum().backward();
  testing::expect_no_errors(testing::run_ranks(4, [&](ProcessGroup& g) {
    auto group = std::shared_ptr<ProcessGroup>(&g, [](ProcessGroup*) {});
    tp::ColumnParallelLinear column(full, tp::ParallelLinearOptions().group(group).output_layout(tp::Replicate()));
    auto xc = x.clone().requires_grad_(true);
    auto out = column(xc);
    expect_close(out, want, "ColumnParallelLinear with output Replicate()");
    out.pow(2).sum().backward();
    expect_close(xc.grad(), whole_x.grad(), "its input's gradient");

    tp::RowParallelLinear row(full, tp::ParallelLinearOptions().group(group).input_layout(tp::Replicate()));
    auto xr = x.clone().requires_grad_(true);
    auto out_row = row(xr);
    expect_close(out_row, want, "RowParallelLinear of a whole input");
    out_row.pow(2).sum().backward();
    expect_close(xr.grad(), whole_x.grad(), "its input's gradient");
  }));
}

// Built from sizes, a module holds its rank's shard of the Linear that the
// same seed makes in one process (the ranks are threads here: the shared
// generator is seeded and drawn under a lock).
TEST(TensorParallel, ModulesBuiltFromSizesHoldTheShardOfTheSameSeedsLinear) {
  torch::manual_seed(9);
  torch::nn::Linear up(6, 8), down(8, 6);
  std::mutex rng;
  testing::expect_no_errors(testing::run_rank_contexts(2, [&](RankContext& ctx) {
    const auto options = tp::ParallelLinearOptions().group(ctx.group);
    std::unique_lock<std::mutex> lock(rng);
    torch::manual_seed(9);
    tp::ColumnParallelLinear column(6, 8, options);
    tp::RowParallelLinear row(8, 6, options);
    lock.unlock();
    EXPECT_TRUE(at::equal(column->weight, shard(up->weight, 0, ctx.rank, 2)));
    EXPECT_TRUE(at::equal(column->bias, shard(up->bias, 0, ctx.rank, 2)));
    EXPECT_TRUE(at::equal(row->weight, shard(down->weight, 1, ctx.rank, 2)));
    EXPECT_TRUE(at::equal(row->bias, down->bias));
    EXPECT_EQ(column->named_parameters().keys(), (std::vector<std::string>{"weight", "bias"}));
  }));
}

TEST(TensorParallel, SizesThatDoNotSplitAndWrongInputsAreNamed) {
  testing::expect_no_errors(testing::run_rank_contexts(4, [&](RankContext& ctx) {
    const auto options = tp::ParallelLinearOptions().group(ctx.group);
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { tp::ColumnParallelLinear(8, 10, options); }),
              "ColumnParallelLinear: out_features (10) does not split over the 4 ranks of group "
              "'default'");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { tp::RowParallelLinear(10, 8, options); }),
              "RowParallelLinear: in_features (10) does not split over the 4 ranks of group "
              "'default'");
    tp::RowParallelLinear row(16, 8, options);
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { row(torch::zeros({2, 16})); }),
              "RowParallelLinear: the input's last dimension is 16, expected 4 (this rank's "
              "share of in_features, as its input layout Shard(-1) says)");
    tp::ColumnParallelLinear column(16, 8, options);
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { column(torch::zeros({2, 4})); }),
              "ColumnParallelLinear: the input's last dimension is 4, expected 16 (in_features)");
  }));
}

// The vocabulary-parallel embedding equals the whole Embedding: output, and
// each rank's rows of the table's gradient.
TEST(TensorParallel, VocabParallelEmbeddingEqualsTheWholeEmbedding) {
  torch::manual_seed(6);
  torch::nn::Embedding full(12, 5);
  const auto ids = torch::randint(0, 12, {4, 3}, torch::kLong);
  auto whole = std::dynamic_pointer_cast<torch::nn::EmbeddingImpl>(full->clone());
  const auto want = whole->forward(ids);
  want.pow(2).sum().backward();
  testing::expect_no_errors(testing::run_rank_contexts(4, [&](RankContext& ctx) {
    tp::VocabParallelEmbedding embedding(full, tp::ParallelLinearOptions().group(ctx.group));
    EXPECT_EQ(embedding->first_id(), 3 * ctx.rank);
    auto out = embedding(ids);
    expect_close(out, want, "VocabParallelEmbedding's output");
    out.pow(2).sum().backward();
    expect_close(embedding->weight.grad(), shard(whole->weight.grad(), 0, ctx.rank, 4),
                 "its rows of the table's gradient");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { embedding(torch::full({2}, 12, torch::kLong)); }),
              "VocabParallelEmbedding: ids must be in [0, 12), got 12");
  }));
}

// loss_parallel: the cross-entropy of logits split along the vocabulary
// equals the whole logits' on every rank, and each rank's logits get their
// slice of the whole gradient.
TEST(TensorParallel, VocabParallelCrossEntropyEqualsTheWholeLoss) {
  torch::manual_seed(8);
  const auto logits = torch::randn({6, 16}) * 3;
  const auto target = torch::randint(0, 16, {6}, torch::kLong);
  auto whole = logits.clone().requires_grad_(true);
  const auto want = torch::nn::functional::cross_entropy(whole, target);
  want.backward();
  for (int ranks : {2, 4}) {
    SCOPED_TRACE("tensor-parallel ranks: " + std::to_string(ranks));
    testing::expect_no_errors(testing::run_rank_contexts(ranks, [&](RankContext& ctx) {
      auto mine = shard(logits, 1, ctx.rank, ranks).clone().requires_grad_(true);
      auto loss = tp::vocab_parallel_cross_entropy(mine, target, ctx.group);
      expect_close(loss, want, "the loss");
      loss.backward();
      expect_close(mine.grad(), shard(whole.grad(), 1, ctx.rank, ranks), "the logits' gradient");
      if (ranks == 2)
        EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                    tp::vocab_parallel_cross_entropy(mine, torch::full({6}, 16, torch::kLong), ctx.group);
                  }),
                  "vocab_parallel_cross_entropy: targets must be in [0, 16) or ignore_index -100 (8 logits on "
                  "each of the 2 ranks of group 'default'), got 16");
    }));
  }
}

// F.cross_entropy's options, as loss_parallel keeps them: padded rows
// (target -100, or another ignore_index) take no part, reduction mean
// (over the rows counted), sum and none, label smoothing; against
// libtorch's own cross_entropy on the whole logits, loss and gradient, on
// 2 and 4 ranks. Before, a padded batch was refused and there was only
// the mean.
TEST(TensorParallel, VocabParallelCrossEntropyKeepsCrossEntropysOptions) {
  namespace F = torch::nn::functional;
  torch::manual_seed(8);
  const auto logits = torch::randn({7, 16}) * 3;
  const auto target = torch::tensor({3, -100, 15, 0, -100, 8, 11}, torch::kLong);
  struct Case {
    std::string name;
    torch::nn::CrossEntropyLossOptions options;
  };
  std::vector<Case> cases = {
      {"padding, mean", torch::nn::CrossEntropyLossOptions()},
      {"padding, sum", torch::nn::CrossEntropyLossOptions().reduction(torch::kSum)},
      {"padding, none", torch::nn::CrossEntropyLossOptions().reduction(torch::kNone)},
      {"padding, smoothing 0.1, mean", torch::nn::CrossEntropyLossOptions().label_smoothing(0.1)},
      {"padding, smoothing 0.2, none",
       torch::nn::CrossEntropyLossOptions().label_smoothing(0.2).reduction(torch::kNone)},
      {"ignore_index 15, smoothing 0.1, sum",
       torch::nn::CrossEntropyLossOptions().ignore_index(15).label_smoothing(0.1).reduction(torch::kSum)},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    // -100 is an ordinary (refused) target when another id is ignored.
    const auto t = c.options.ignore_index() == -100 ? target : target.clamp_min(0);
    auto whole = logits.clone().requires_grad_(true);
    F::CrossEntropyFuncOptions f;
    f.ignore_index(c.options.ignore_index()).label_smoothing(c.options.label_smoothing());
    const std::string reduction = torch::enumtype::get_enum_name(c.options.reduction());
    if (reduction == "kSum") f.reduction(torch::kSum);
    if (reduction == "kNone") f.reduction(torch::kNone);
    const auto want = F::cross_entropy(whole, t, f);
    const auto upstream = torch::arange(want.numel(), torch::kFloat).view_as(want) * 0.1 + 1;
    (want * upstream).sum().backward();
    for (int ranks : {2, 4}) {
      SCOPED_TRACE("tensor-parallel ranks: " + std::to_string(ranks));
      testing::expect_no_errors(testing::run_rank_contexts(ranks, [&](RankContext& ctx) {
        auto mine = shard(logits, 1, ctx.rank, ranks).clone().requires_grad_(true);
        auto loss = tp::vocab_parallel_cross_entropy(mine, t, ctx.group, c.options);
        expect_close(loss, want, "the loss");
        (loss * upstream).sum().backward();
        expect_close(mine.grad(), shard(whole.grad(), 1, ctx.rank, ranks), "the logits' gradient");
      }));
    }
  }
  testing::expect_no_errors(testing::run_rank_contexts(2, [&](RankContext& ctx) {
    const auto mine = shard(logits, 1, ctx.rank, 2);
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                tp::vocab_parallel_cross_entropy(mine, target, ctx.group,
                                                 torch::nn::CrossEntropyLossOptions().weight(torch::ones({16})));
              }),
              "vocab_parallel_cross_entropy: class weights (CrossEntropyLossOptions::weight) are not supported");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                tp::vocab_parallel_cross_entropy(mine, target, ctx.group,
                                                 torch::nn::CrossEntropyLossOptions().ignore_index(0));
              }),
              "vocab_parallel_cross_entropy: targets must be in [0, 16) or ignore_index 0 (8 logits on each of "
              "the 2 ranks of group 'default'), got -100");
    // Every row padded: NaN, as PyTorch's mean of nothing.
    EXPECT_TRUE(std::isnan(
        tp::vocab_parallel_cross_entropy(mine, torch::full({7}, -100, torch::kLong), ctx.group).item<double>()));
  }));
}

}  // namespace
}  // namespace dtrain
