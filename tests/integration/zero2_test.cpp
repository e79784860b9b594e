// ZeRO-2: DDP with shard_gradients(true) reduce-scatters its buckets and a
// ZeroRedundancyOptimizer built over it steps on each rank's share. After
// 20 steps the parameters equal plain DDP's with the same optimizer, for
// 2, 3 and 4 ranks, with many small buckets (uneven slices, padding),
// with several synchronized backwards per step and with no_sync; no rank holds a full
// gradient; misuse is refused with errors that say what to do.

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

constexpr int kZero2Batch = 4;
constexpr int kZero2Steps = 20;

// Buckets of about 100 bytes: the MLP's parameters fall into 3 buckets,
// the convnet's into 2.
DDPOptions sharded(const std::shared_ptr<ProcessGroup>& group) {
  return DDPOptions().process_group(group).shard_gradients(true).bucket_cap_mb(0.0001);
}

template <typename Impl>
void expect_zero2_equals_plain(int world, const testing::MakeOptimizer& make) {
  auto data = testing::make_data<Impl>(world * kZero2Batch, kZero2Steps);
  std::vector<std::shared_ptr<Impl>> plain, zero2;
  for (int r = 0; r < world; ++r) {
    plain.push_back(testing::make_model<Impl>(0));
    zero2.push_back(testing::make_model<Impl>(0));
  }
  auto errors = run_rank_contexts(world, [&](RankContext& ctx) {
    const int r = ctx.rank;
    auto other = create_process_group("tcp", std::make_shared<PrefixStore>("zero2", ctx.store), r,
                                      world, GroupOptions().name("zero2").timeout(60s));
    DistributedDataParallel ddp_plain(plain[r], DDPOptions().process_group(ctx.group));
    DistributedDataParallel ddp_zero(zero2[r], sharded(other));
    auto opt_plain = make(ddp_plain.parameters());
    ZeroRedundancyOptimizer opt_zero(ddp_zero, make);
    EXPECT_GE(opt_zero.local_optimizer().param_groups()[0].params().size(), 2u)
        << "one slice per bucket";
    for (int s = 0; s < kZero2Steps; ++s) {
      auto x = data[s].x.narrow(0, r * kZero2Batch, kZero2Batch), y = data[s].y.narrow(0, r * kZero2Batch, kZero2Batch);
      // Every third step takes two synchronized backwards (halves of the
      // batch): their averages add up, as .grad does under plain DDP. The
      // step after that accumulates its first half under no_sync.
      const int parts = s % 3 == 2 ? 1 : 2;
      const bool first_local = s % 3 == 1;
      opt_plain->zero_grad();
      for (int k = 0; k < parts; ++k) {
        auto xs = x.chunk(parts)[k], ys = y.chunk(parts)[k];
        if (k == 0 && first_local) {
          auto guard_plain = ddp_plain.no_sync();
          auto guard_zero = ddp_zero.no_sync();
          torch::mse_loss(ddp_plain.forward(xs), ys).backward();
          torch::mse_loss(ddp_zero.forward(xs), ys).backward();
          continue;
        }
        torch::mse_loss(ddp_plain.forward(xs), ys).backward();
        torch::mse_loss(ddp_zero.forward(xs), ys).backward();
      }
      for (const auto& p : zero2[r]->parameters())
        ASSERT_FALSE(p.grad().defined()) << "a full gradient was kept at step " << s;
      opt_plain->step();
      opt_zero.step();
    }
    // Equal to float rounding: under plain DDP an accumulated .grad holds
    // the first average plus the next local gradient, averaged again; here
    // the two averages are added.
    const std::vector<torch::Tensor> a = plain[r]->parameters(), b = zero2[r]->parameters();
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-6, 1e-6))
          << "rank " << r << " parameter " << i << " max diff "
          << (a[i] - b[i]).abs().max().item<double>();
    // The state, consolidated: plain DDP's to float rounding (all-reduce
    // and reduce-scatter add the ranks' gradients in different orders).
    const auto full = opt_zero.consolidate_state_dict(0);
    if (r != 0) return;
    for (size_t i = 0; i < a.size(); ++i) {
      auto reference = optim::detail::param_state(*opt_plain, a[i]);
      for (const auto& [field, value] : reference.tensors)
        EXPECT_TRUE(torch::allclose(full.at(std::to_string(i) + "/" + field), value, 1e-5, 1e-6))
            << "parameter " << i << " " << field << " max diff "
            << (full.at(std::to_string(i) + "/" + field) - value).abs().max().template item<double>() << " of max "
            << value.abs().max().template item<double>();
    }
  }, 120s);
  testing::expect_no_errors(errors);
}

class Zero2Worlds : public ::testing::TestWithParam<int> {};

TEST_P(Zero2Worlds, AdamMatchesDdpWithAdam) {
  expect_zero2_equals_plain<testing::MLPImpl>(GetParam(), testing::kAdam);
}
TEST_P(Zero2Worlds, SgdMomentumMatchesDdpWithSgdMomentum) {
  expect_zero2_equals_plain<testing::ConvNetImpl>(GetParam(), testing::kSgdMomentum);
}
INSTANTIATE_TEST_SUITE_P(Zero2, Zero2Worlds, ::testing::Values(2, 3, 4));

// A rank's gradient memory after backward is its shares: the sum over
// buckets of ceil(bucket / 3), not the model's 484 elements.
TEST(Zero2, EachRankKeepsOnlyItsGradientShares) {
  std::vector<std::shared_ptr<testing::MLPImpl>> models;
  for (int r = 0; r < 3; ++r) models.push_back(testing::make_model<testing::MLPImpl>(0));
  auto x = torch::randn({2, 10});
  auto errors = run_rank_contexts(3, [&](RankContext& ctx) {
    DistributedDataParallel ddp(models[ctx.rank], sharded(ctx.group));
    ZeroRedundancyOptimizer opt(ddp, testing::kAdam);
    torch::mse_loss(ddp.forward(x), torch::zeros({2, 4})).backward();
    const auto buckets = ddp.stats().bucket_bytes;
    int64_t expected = 0, total = 0;
    for (int64_t bytes : buckets) {
      expected += (bytes / 4 + 2) / 3;
      total += bytes / 4;
    }
    EXPECT_EQ(total, 484);
    int64_t held = 0;
    for (const auto& shard : opt.local_optimizer().param_groups()[0].params()) held += shard.numel();
    EXPECT_EQ(held, expected);
    EXPECT_LE(held, 484 / 3 + static_cast<int64_t>(buckets.size()));
    for (const auto& p : models[ctx.rank]->parameters()) EXPECT_FALSE(p.grad().defined());
    opt.step();
    // Adam's state covers the shares only.
    int64_t state = 0;
    for (const auto& [key, s] : opt.local_optimizer().state())
      state += static_cast<torch::optim::AdamParamState&>(*s).exp_avg().numel();
    EXPECT_EQ(state, expected);
    EXPECT_THROW(opt.shard_begin(), InvalidArgument);
  });
  testing::expect_no_errors(errors);
}

TEST(Zero2, MisuseIsRefusedWithWhatToDo) {
  auto model = testing::make_model<testing::MLPImpl>(0);
  auto errors = run_rank_contexts(1, [&](RankContext& ctx) {
    auto x = torch::ones({2, 10});
    DistributedDataParallel ddp(model, sharded(ctx.group));
    try {
      ddp.forward(x);
      ADD_FAILURE() << "a sharded DDP without its optimizer ran a forward";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "no ZeroRedundancyOptimizer is built over this DDP"));
      EXPECT_TRUE(testing::Contains(e.what(), "ZeroRedundancyOptimizer(ddp, factory)"));
    }
    try {
      ddp.register_comm_hook(fp16_compress_hook());
      ADD_FAILURE() << "a comm hook was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "reduce-scatters its buckets itself"));
    }
    try {
      ddp.join([] {});
      ADD_FAILURE() << "join was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "not available with shard_gradients(true)"));
    }
    {
      ZeroRedundancyOptimizer opt(ddp, testing::kAdam);
      try {
        ZeroRedundancyOptimizer second(ddp, testing::kAdam);
        ADD_FAILURE() << "two optimizers over one sharded DDP";
      } catch (const InvalidArgument& e) {
        EXPECT_TRUE(testing::Contains(e.what(), "already has a ZeroRedundancyOptimizer"));
      }
      EXPECT_NO_THROW(ddp.forward(x).sum().backward());
    }
    // Its optimizer is gone: the next forward says so instead of training
    // without one.
    EXPECT_THROW(ddp.forward(x), InvalidArgument);

    auto plain_model = testing::make_model<testing::MLPImpl>(0);
    DistributedDataParallel plain(plain_model, DDPOptions().process_group(ctx.group));
    try {
      ZeroRedundancyOptimizer opt(plain, testing::kAdam);
      ADD_FAILURE() << "ZeRO-2 over a DDP without shard_gradients";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "built without DDPOptions().shard_gradients(true)"));
    }
    auto third = testing::make_model<testing::MLPImpl>(0);
    try {
      DistributedDataParallel bad(third, sharded(ctx.group).gradient_as_bucket_view(true));
      ADD_FAILURE() << "shard_gradients with gradient_as_bucket_view";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "shard_gradients and gradient_as_bucket_view exclude each other"));
    }
  });
  testing::expect_no_errors(errors);
}

}  // namespace
}  // namespace dtrain
