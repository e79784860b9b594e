// ZeroRedundancyOptimizer: with DDP averaging the gradients, parameters
// after every step equal those of DDP with the same optimizer over all
// parameters (element-wise optimizers), for 2, 3 and 4 ranks, with
// partitions that split parameters across ranks and leave the last slice
// short; each rank holds only its slice's optimizer state.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "optim/optimizer_state.h"
#include "dtrain/dtrain.h"
#include "harness/assertions.h"
#include "harness/thread_ranks.h"
#include "harness/training.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::RankContext;
using testing::run_rank_contexts;

constexpr int kZeroBatch = 4;
constexpr int kZeroSteps = 20;

using testing::kAdam;
using testing::kSgdMomentum;
using testing::MakeOptimizer;


template <typename Impl>
void expect_zero_equals_plain(int world, const MakeOptimizer& make) {
  auto data = testing::make_data<Impl>(world * kZeroBatch, kZeroSteps);
  std::vector<std::shared_ptr<Impl>> plain, sharded;
  for (int r = 0; r < world; ++r) {
    plain.push_back(testing::make_model<Impl>(0));
    sharded.push_back(testing::make_model<Impl>(0));
  }
  std::vector<std::string> errors = run_rank_contexts(world, [&](RankContext& ctx) {
    const int r = ctx.rank;
    auto other = create_process_group("tcp", std::make_shared<PrefixStore>("zero", ctx.store), r,
                                      world, GroupOptions().name("zero").timeout(60s));
    DistributedDataParallel ddp_plain(plain[r], DDPOptions().process_group(ctx.group));
    DistributedDataParallel ddp_zero(sharded[r], DDPOptions().process_group(other));
    auto opt_plain = make(ddp_plain.parameters());
    ZeroRedundancyOptimizer opt_zero(ddp_zero.parameters(), make,
                                     ZeroRedundancyOptions().process_group(other));
    // Each rank steps only its slice, balanced to within one element.
    const int64_t slice = (opt_zero.numel() + world - 1) / world;
    EXPECT_EQ(opt_zero.shard_begin(), std::min<int64_t>(opt_zero.numel(), r * slice));
    for (int s = 0; s < kZeroSteps; ++s) {
      auto x = data[s].x.narrow(0, r * kZeroBatch, kZeroBatch), y = data[s].y.narrow(0, r * kZeroBatch, kZeroBatch);
      opt_plain->zero_grad();
      torch::mse_loss(ddp_plain.forward(x), y).backward();
      opt_plain->step();
      opt_zero.zero_grad();
      torch::mse_loss(ddp_zero.forward(x), y).backward();
      opt_zero.step();
    }
    const std::vector<torch::Tensor> a = plain[r]->parameters(), b = sharded[r]->parameters();
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-6, 1e-7))
          << "rank " << r << " parameter " << i << " max diff "
          << (a[i] - b[i]).abs().max().item<double>();
    // The whole optimizer state, consolidated on the last rank, is the
    // plain optimizer's.
    const int to = world - 1;
    const auto full = opt_zero.consolidate_state_dict(to);
    if (r != to) {
      EXPECT_TRUE(full.empty());
      return;
    }
    for (size_t i = 0; i < a.size(); ++i) {
      auto reference = optim::detail::param_state(*opt_plain, a[i]);
      for (const auto& [field, value] : reference.tensors) {
        const auto& got = full.at(std::to_string(i) + "/" + field);
        EXPECT_TRUE(torch::allclose(got, value, 1e-5, 1e-8)) << "parameter " << i << " " << field;
      }
      if (reference.step.defined()) EXPECT_EQ(full.at("step").item<int64_t>(), kZeroSteps);
    }
  }, 120s);
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

class ZeroWorlds : public ::testing::TestWithParam<int> {};

TEST_P(ZeroWorlds, AdamMatchesDdpWithAdam) {
  expect_zero_equals_plain<testing::MLPImpl>(GetParam(), kAdam);
}
TEST_P(ZeroWorlds, SgdMomentumMatchesDdpWithSgdMomentum) {
  expect_zero_equals_plain<testing::ConvNetImpl>(GetParam(), kSgdMomentum);
}
INSTANTIATE_TEST_SUITE_P(Zero, ZeroWorlds, ::testing::Values(2, 3, 4));

// Adam keeps two state tensors per parameter element: each rank holds them
// for its slice only (ceil(N/3) of N elements at 3 ranks).
TEST(Zero, EachRankHoldsOnlyItsSlicesState) {
  auto models = std::vector<std::shared_ptr<testing::MLPImpl>>{};
  for (int r = 0; r < 3; ++r) models.push_back(testing::make_model<testing::MLPImpl>(0));
  auto errors = run_rank_contexts(3, [&](RankContext& ctx) {
    ZeroRedundancyOptimizer opt(models[ctx.rank]->parameters(), kAdam,
                                ZeroRedundancyOptions().process_group(ctx.group));
    torch::mse_loss(models[ctx.rank]->forward(torch::randn({2, 10})), torch::zeros({2, 4})).backward();
    opt.step();
    int64_t state_elements = 0;
    for (const auto& [key, state] : opt.local_optimizer().state()) {
      auto& adam = static_cast<torch::optim::AdamParamState&>(*state);
      state_elements += adam.exp_avg().numel() + adam.exp_avg_sq().numel();
    }
    const int64_t n = opt.numel();  // 10*32 + 32 + 32*4 + 4 = 484
    EXPECT_EQ(n, 484);
    EXPECT_EQ(state_elements, 2 * ((n + 2) / 3));
    EXPECT_TRUE(opt.state().empty()) << "the wrapper itself keeps no state";
    // No copies of the parameters: they are views of one buffer, and the
    // local optimizer steps on this rank's slice of it.
    const auto params = models[ctx.rank]->parameters();
    for (const auto& p : params) EXPECT_TRUE(p.is_alias_of(params.front()));
    EXPECT_TRUE(opt.local_optimizer().param_groups()[0].params()[0].is_alias_of(params.front()));
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

// A scheduler on the wrapper reaches the local optimizer.
TEST(Zero, LearningRateSchedulersDriveTheLocalOptimizer) {
  auto model = testing::make_model<testing::MLPImpl>(0);
  auto errors = run_rank_contexts(1, [&](RankContext& ctx) {
    ZeroRedundancyOptimizer opt(model->parameters(), kSgdMomentum,
                                ZeroRedundancyOptions().process_group(ctx.group));
    torch::optim::StepLR schedule(opt, /*step_size=*/1, /*gamma=*/0.5);
    schedule.step();  // libtorch's schedulers change lr from their second step on
    schedule.step();
    EXPECT_DOUBLE_EQ(opt.param_groups()[0].options().get_lr(), 0.025);
    torch::mse_loss(model->forward(torch::randn({2, 10})), torch::zeros({2, 4})).backward();
    opt.step();
    EXPECT_DOUBLE_EQ(opt.local_optimizer().param_groups()[0].options().get_lr(), 0.025);
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST(Zero, BadParametersAreNamed) {
  auto errors = run_rank_contexts(1, [&](RankContext& ctx) {
    auto opts = ZeroRedundancyOptions().process_group(ctx.group);
    try {
      ZeroRedundancyOptimizer opt({torch::zeros({2}), torch::zeros({2}, torch::kDouble)}, kAdam, opts);
      ADD_FAILURE() << "mixed dtypes were accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "parameter 1 is Double on cpu but parameter 0 is Float"))
          << e.what();
    }
    try {
      ZeroRedundancyOptimizer opt({}, kAdam, opts);
      ADD_FAILURE() << "no parameters were accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "no parameters to optimize")) << e.what();
    }
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

}  // namespace
}  // namespace dtrain
