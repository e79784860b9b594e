// PowerSGD across DDP's bucket rebuild: the hook's state (Q, error
// feedback) must follow the parameters, not the bucket numbers, which DDP
// reassigns after the first iteration.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <mutex>

#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using testing::RankContext;
using testing::run_rank_contexts;

constexpr int kWorld = 2, kPowerSgdBatch = 4, kPowerSgdSteps = 6;
using Widths = std::vector<int64_t>;  // input, then the output of l1 .. l4

// Four layers applied l1, l2, l3, l4, registered in `order`. The gradients
// become ready l4, l3, l2, l1 (what DDP rebuilds its buckets to); the first
// buckets follow the reverse registration order.
struct ChainImpl : torch::nn::Module {
  ChainImpl(const Widths& widths, const std::vector<std::string>& order) {
    for (const auto& name : order) {
      const int k = name.back() - '0';
      auto layer = register_module(name, torch::nn::Linear(widths[k - 1], widths[k]));
      torch::manual_seed(k);  // the same weights whatever the order
      torch::NoGradGuard no_grad;
      layer->weight.copy_(torch::randn({widths[k], widths[k - 1]}) * 0.3);
      layer->bias.copy_(torch::randn({widths[k]}) * 0.1);
      layers.emplace(name, layer);
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const char* name : {"l1", "l2", "l3", "l4"}) x = torch::tanh(layers.at(name)(x));
    return x;
  }
  std::map<std::string, torch::nn::Linear> layers;
};

// Bucket cap putting each layer (weight and bias, whichever comes first)
// in a bucket of its own: no single tensor reaches it, every layer does.
double one_layer_per_bucket_mb(const Widths& w) {
  int64_t cap = INT64_MAX, largest = 0;
  for (size_t k = 1; k < w.size(); ++k) {
    cap = std::min(cap, (w[k] * w[k - 1] + w[k]) * 4);
    largest = std::max(largest, w[k] * w[k - 1] * 4);
  }
  EXPECT_LT(largest, cap) << "these widths cannot have one layer per bucket";
  return static_cast<double>(cap) / (1 << 20);
}

struct Run {
  std::map<std::string, torch::Tensor> params;  // rank 0's, after training
  // Rank 0's buckets: iteration -> bucket index -> parameter names, sorted.
  std::map<int64_t, std::map<int, std::vector<std::string>>> buckets;
};

Run train(const Widths& widths, const std::vector<std::string>& order) {
  std::vector<std::shared_ptr<ChainImpl>> models;
  for (int r = 0; r < kWorld; ++r) models.push_back(std::make_shared<ChainImpl>(widths, order));
  torch::manual_seed(99);
  auto x = torch::randn({kWorld * kPowerSgdBatch, widths.front()});
  auto y = torch::randn({kWorld * kPowerSgdBatch, widths.back()});
  Run run;
  std::mutex mutex;
  testing::expect_no_errors(run_rank_contexts(kWorld, [&](RankContext& ctx) {
    DistributedDataParallel ddp(models[ctx.rank], DDPOptions().process_group(ctx.group)
                                                      .bucket_cap_mb(one_layer_per_bucket_mb(widths)));
    auto powersgd = powersgd_hook(PowerSGDOptions().start_powersgd_iter(0).use_error_feedback(true));
    ddp.register_comm_hook([&, powersgd, rank = ctx.rank](ProcessGroup& g, GradBucket& b) {
      if (rank == 0) {
        auto names = b.parameter_names;
        std::sort(names.begin(), names.end());
        std::lock_guard<std::mutex> lock(mutex);
        run.buckets[b.iteration][b.index] = names;
      }
      powersgd(g, b);
    });
    torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.1));
    auto xs = x.narrow(0, ctx.rank * kPowerSgdBatch, kPowerSgdBatch), ys = y.narrow(0, ctx.rank * kPowerSgdBatch, kPowerSgdBatch);
    for (int s = 0; s < kPowerSgdSteps; ++s) {
      opt.zero_grad();
      torch::mse_loss(ddp.forward(xs), ys).backward();
      opt.step();
    }
  }));
  for (const auto& item : models[0]->named_parameters())
    run.params[item.key()] = item.value().detach().clone();
  return run;
}

// SameShapes: state given to the wrong layer fails no shape check (silently
// wrong error feedback). MixedShapes: bucket 1 goes from a 16x8 to an 8x16
// weight (a shape error).
class PowerSGDRebuild : public ::testing::TestWithParam<Widths> {};

TEST_P(PowerSGDRebuild, StateFollowsParametersAcrossTheBucketRebuild) {
  const auto& widths = GetParam();
  // Registered in the order they run: the rebuild keeps every bucket as it was.
  const auto steady = train(widths, {"l1", "l2", "l3", "l4"});
  // Registered out of order: the rebuild gives bucket i another layer.
  const auto rebuilt = train(widths, {"l3", "l1", "l4", "l2"});
  if (HasFailure()) return;

  ASSERT_EQ(steady.buckets.size(), size_t(kPowerSgdSteps));
  ASSERT_EQ(rebuilt.buckets.size(), size_t(kPowerSgdSteps));
  EXPECT_EQ(steady.buckets.at(0), steady.buckets.at(1)) << "the reference's buckets changed";
  ASSERT_EQ(rebuilt.buckets.at(0).size(), 4u);
  EXPECT_NE(rebuilt.buckets.at(0).at(0), rebuilt.buckets.at(1).at(0))
      << "bucket 0 holds the same parameters after the rebuild: the test exercises nothing";
  EXPECT_EQ(rebuilt.buckets.at(1), steady.buckets.at(1)) << "rebuilt to another layout";

  // PowerSGD compresses each matrix on its own: with its state kept per
  // parameter, how parameters were bucketed must not change the result.
  ASSERT_EQ(steady.params.size(), rebuilt.params.size());
  for (const auto& [name, want] : steady.params) {
    const auto& got = rebuilt.params.at(name);
    EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-6))
        << name << " differs by up to " << (got - want).abs().max().item<float>();
  }
  // And PowerSGD did train: the result is not the initial weights.
  ChainImpl initial(widths, {"l1", "l2", "l3", "l4"});
  EXPECT_FALSE(torch::allclose(steady.params.at("l1.weight"), initial.layers.at("l1")->weight));
}

INSTANTIATE_TEST_SUITE_P(Layers, PowerSGDRebuild,
                         ::testing::Values(Widths{16, 16, 16, 16, 16}, Widths{16, 8, 16, 8, 16}),
                         [](const auto& info) {
                           return info.index == 0 ? "SameShapes" : "MixedShapes";
                         });

}  // namespace
}  // namespace dtrain
