// The plan form: parallelize_module rebuilds a Sequential with the
// tensor-parallel forms of the children its plan names. An MLP planned
// ColwiseParallel / RowwiseParallel, and a norm and an MLP planned with
// sequence parallelism, equal one process over 5 Adam steps at 2 ranks,
// keep their parameter names, and share what the plan leaves out; plans
// that cannot apply are named.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "dtrain/tensor_parallel.h"
#include "harness/assertions.h"
#include "harness/shards.h"
#include "harness/thread_ranks.h"
#include "harness/training.h"

namespace dtrain {
namespace {

namespace tp = tensor_parallel;
using testing::expect_close;
using testing::RankContext;
using testing::shard;

constexpr int kSteps = 5, kRanks = 2;

torch::nn::Sequential mlp() {
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Functional(torch::tanh),
                               torch::nn::Linear(16, 8));
}

torch::nn::Sequential copy_of(const torch::nn::Sequential& s) {
  return torch::nn::Sequential(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(s->clone()));
}

// The model trained in one process on whole inputs, and at kRanks ranks
// after parallelize_module on `mine(x)` (with sequence parallelism, this
// rank's part of the sequence); `split` gives the dimension along which a
// parameter is sharded (-1: whole).
void expect_plan_equals_one_process(const torch::nn::Sequential& model, const tp::ParallelizePlan& plan,
                                    const std::function<int64_t(const std::string&)>& split,
                                    int64_t sequence_dim) {
  std::vector<at::Tensor> xs, ys;
  for (int step = 0; step < kSteps; ++step) {
    xs.push_back(torch::randn({2, 4, 8}));
    ys.push_back(torch::randn({2, 4, 8}));
  }
  auto whole = copy_of(model);
  auto adam = testing::kAdam(whole->parameters());
  at::Tensor first_output;
  for (int step = 0; step < kSteps; ++step) {
    adam->zero_grad();
    auto out = whole->forward(xs[step]);
    if (step == 0) first_output = out.detach().clone();
    torch::mse_loss(out, ys[step]).backward();
    adam->step();
  }
  testing::expect_no_errors(testing::run_rank_contexts(kRanks, [&](RankContext& ctx) {
    const int r = ctx.rank;
    auto mine = [&](const at::Tensor& t) { return sequence_dim < 0 ? t : shard(t, sequence_dim, r, kRanks); };
    auto parallel = tp::parallelize_module(copy_of(model), ctx.group, plan);
    EXPECT_EQ(parallel->named_parameters().keys(), whole->named_parameters().keys());
    auto opt = testing::kAdam(parallel->parameters());
    for (int step = 0; step < kSteps; ++step) {
      opt->zero_grad();
      auto out = parallel->forward(mine(xs[step]));
      if (step == 0) expect_close(out, mine(first_output), "the first output");
      const double parts = sequence_dim < 0 ? 1 : kRanks;
      ((out - mine(ys[step])).pow(2).sum() / (xs[step].numel() / parts) / parts).backward();
      opt->step();
    }
    for (const auto& item : parallel->named_parameters()) {
      const at::Tensor want = whole->named_parameters()[item.key()];  // a copy: the dict is a temporary
      const int64_t dim = split(item.key());
      expect_close(item.value(), dim < 0 ? want : shard(want, dim, r, kRanks), item.key() + " after 5 steps");
    }
  }));
}

TEST(TensorParallelPlan, AColwiseThenRowwiseMlpEqualsOneProcess) {
  torch::manual_seed(21);
  const auto model = mlp();
  const tp::ParallelizePlan plan = {{"0", tp::ColwiseParallel()}, {"2", tp::RowwiseParallel()}};
  expect_plan_equals_one_process(model, plan, [](const std::string& name) -> int64_t {
    if (name == "0.weight" || name == "0.bias") return 0;
    return name == "2.weight" ? 1 : -1;
  }, -1);
  testing::expect_no_errors(testing::run_rank_contexts(kRanks, [&](RankContext& ctx) {
    auto parallel = tp::parallelize_module(model, ctx.group, plan);
    EXPECT_TRUE(parallel->ptr(0)->as<tp::ColumnParallelLinear>());
    EXPECT_TRUE(parallel->ptr(2)->as<tp::RowParallelLinear>());
    EXPECT_EQ(parallel->ptr(1).get(), model->ptr(1).get()) << "what the plan leaves out is shared";
  }));
}

TEST(TensorParallelPlan, ANormAndAnMlpWithSequenceParallelismEqualOneProcess) {
  torch::manual_seed(22);
  torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({8}));
  {
    torch::NoGradGuard no_grad;
    norm->weight.normal_(1.0, 0.3);
    norm->bias.normal_(0.0, 0.3);
  }
  const torch::nn::Sequential model(norm, torch::nn::Linear(8, 16), torch::nn::GELU(),
                                    torch::nn::Linear(16, 8));
  const tp::ParallelizePlan plan = {{"0", tp::SequenceParallel()},
                                    {"1", tp::ColwiseParallel().input_layouts(tp::Shard(1))},
                                    {"3", tp::RowwiseParallel().output_layouts(tp::Shard(1))}};
  expect_plan_equals_one_process(model, plan, [](const std::string& name) -> int64_t {
    if (name == "1.weight" || name == "1.bias") return 0;
    return name == "3.weight" ? 1 : -1;
  }, 1);
}

TEST(TensorParallelPlan, PlansThatCannotApplyAreNamed) {
  testing::expect_no_errors(testing::run_rank_contexts(kRanks, [&](RankContext& ctx) {
    const auto model = mlp();
    auto plan_error = [&](const tp::ParallelizePlan& plan) {
      return testing::what_thrown<InvalidArgument>([&] { tp::parallelize_module(model, ctx.group, plan); });
    };
    // The type's name is libtorch's (torch::nn::FunctionalImpl on 1.13).
    const auto not_linear = plan_error({{"1", tp::ColwiseParallel()}});
    EXPECT_EQ(not_linear.rfind("parallelize_module: '1' is a torch::nn::Functional", 0), 0u) << not_linear;
    EXPECT_TRUE(testing::Contains(not_linear, "; ColwiseParallel takes a torch::nn::Linear")) << not_linear;
    EXPECT_EQ(plan_error({{"5", tp::RowwiseParallel()}}),
              "parallelize_module: the plan's RowwiseParallel entry '5' names no child of the Sequential");
    EXPECT_EQ(plan_error({{"3", tp::SequenceParallel()}}),
              "parallelize_module: the plan's SequenceParallel entry '3' names no child of the Sequential");
    torch::nn::Sequential with_embedding(torch::nn::Embedding(12, 4));
    auto parallel = tp::parallelize_module(with_embedding, ctx.group, {{"0", tp::RowwiseParallel()}});
    ASSERT_TRUE(parallel->ptr(0)->as<tp::VocabParallelEmbedding>());
    EXPECT_EQ(parallel->ptr(0)->as<tp::VocabParallelEmbedding>()->weight.sizes(),
              (std::vector<int64_t>{6, 4}));
  }));
}

}  // namespace
}  // namespace dtrain
