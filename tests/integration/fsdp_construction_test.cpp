// ShardedConstruction: FullyShard units sharded the moment they are
// constructed. While the model is built no unit holds its full
// parameters once its constructor has returned; wrapped in FSDP it trains
// like DDP from rank 0's values; misuse is named.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <set>

#include "dtrain/dtrain.h"
#include "harness/assertions.h"
#include "harness/fsdp_models.h"
#include "harness/thread_ranks.h"
#include "harness/training.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::RankContext;
using testing::run_rank_contexts;

int64_t held_bytes(torch::nn::Module& module) {
  std::set<const void*> seen;
  int64_t bytes = 0;
  for (const auto& p : module.parameters())
    if (seen.insert(p.storage().unsafeGetStorageImpl()).second) bytes += p.storage().nbytes();
  return bytes;
}

// Blocks (each a unit with two nested units) that note, after each one is
// built, the most parameter memory the blocks built so far held.
struct CountingStackImpl : torch::nn::Module {
  explicit CountingStackImpl(int depth = 3, int64_t d = 16) {
    proj = register_module("proj", torch::nn::Linear(10, d));
    for (int i = 0; i < depth; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i),
                                       std::make_shared<FullyShard<testing::BlockImpl>>(d)));
      int64_t held = 0;
      for (auto& block : blocks) held += held_bytes(*block);
      most_held = std::max(most_held, held);
    }
    head = register_module("head", torch::nn::Linear(d, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = proj(x);
    for (auto& block : blocks) x = block->forward(x);
    return head(x.mean(1));
  }
  torch::nn::Linear proj{nullptr}, head{nullptr};
  std::vector<std::shared_ptr<FullyShard<testing::BlockImpl>>> blocks;
  int64_t most_held = 0;
};

const testing::MakeOptimizer kAdam = [](std::vector<torch::Tensor> p) {
  return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-3));
};

class ShardedConstructionWorlds : public ::testing::TestWithParam<int> {};

TEST_P(ShardedConstructionWorlds, NoUnitStaysWholeAndTrainingMatchesDdp) {
  const int world = GetParam(), steps = 5;
  // Built in full, the blocks hold all their parameters: the measure works.
  EXPECT_GT(CountingStackImpl().most_held, 0);
  // Fixed values to train from, and fixed data: Adam turns an element's
  // gradient that rounding alone makes nonzero into a step of about lr, and
  // reduce-scatter and allreduce round differently, so from some random
  // values an element of FSDP and DDP would part by lr (CI saw one such run).
  torch::manual_seed(20261128);
  std::map<std::string, at::Tensor> start;
  for (const auto& item : CountingStackImpl().named_parameters()) start[item.key()] = item.value().detach().clone();
  std::vector<torch::Tensor> xs, ys;
  for (int s = 0; s < steps * world; ++s) xs.push_back(torch::randn({4, 3, 10})), ys.push_back(torch::randn({4, 4}));
  auto errors = run_rank_contexts(world, [&](RankContext& ctx) {
    const int r = ctx.rank;
    std::shared_ptr<CountingStackImpl> model;
    {
      ShardedConstruction sharded(ctx.group);
      model = std::make_shared<CountingStackImpl>();  // each rank's own random values
    }
    EXPECT_EQ(model->most_held, 0) << "a unit kept its full parameters after its constructor";
    FullyShardedDataParallel fsdp(model, FSDPOptions().process_group(ctx.group));
    // The shards made while building now take the fixed values, as does a
    // plain replica.
    fsdp.load_full_state_dict(start);
    auto plain = std::make_shared<CountingStackImpl>();
    {
      torch::NoGradGuard no_grad;
      for (auto& item : plain->named_parameters()) item.value().copy_(start.at(item.key()));
    }
    auto other = create_process_group("tcp", std::make_shared<PrefixStore>("plain", ctx.store), r, world,
                                      GroupOptions().name("plain").timeout(60s));
    DistributedDataParallel ddp(plain, DDPOptions().process_group(other));
    auto opt_fsdp = kAdam(fsdp.parameters());
    auto opt_ddp = kAdam(ddp.parameters());
    for (int s = 0; s < steps; ++s) {
      opt_fsdp->zero_grad();
      torch::mse_loss(fsdp.forward(xs[s * world + r]), ys[s * world + r]).backward();
      opt_fsdp->step();
      opt_ddp->zero_grad();
      torch::mse_loss(ddp.forward(xs[s * world + r]), ys[s * world + r]).backward();
      opt_ddp->step();
    }
    const auto trained = fsdp.full_state_dict();
    for (const auto& item : plain->named_parameters())
      EXPECT_TRUE(torch::allclose(trained.at(item.key()), item.value(), 1e-5, 1e-6))
          << "rank " << r << " '" << item.key() << "'";
  }, 120s);
  testing::expect_no_errors(errors);
}
INSTANTIATE_TEST_SUITE_P(ShardedConstruction, ShardedConstructionWorlds, ::testing::Values(2, 3));

// Mixed precision is chosen when FSDP wraps the model: the units built in
// fp32 compute in bf16 and keep fp32 shards.
TEST(ShardedConstruction, MixedPrecisionAppliesAfterwards) {
  auto x = torch::randn({4, 3, 10});
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    std::shared_ptr<testing::BlockStackImpl> model;
    {
      ShardedConstruction sharded(ctx.group);
      model = std::make_shared<testing::BlockStackImpl>();
    }
    FullyShardedDataParallel fsdp(model, FSDPOptions().process_group(ctx.group).mixed_precision(
                                             MixedPrecision().param_dtype(at::kBFloat16)));
    auto out = fsdp.forward(x);
    EXPECT_EQ(out.scalar_type(), at::kBFloat16);
    out.to(at::kFloat).pow(2).mean().backward();
    for (const auto& shard : fsdp.parameters()) {
      EXPECT_EQ(shard.scalar_type(), at::kFloat);
      EXPECT_TRUE(shard.grad().defined());
    }
  });
  testing::expect_no_errors(errors);
}

TEST(ShardedConstruction, MisuseIsNamed) {
  auto x = torch::randn({2, 3, 16});
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    // Ranks building different models: named before any value is sent.
    try {
      ShardedConstruction sharded(ctx.group);
      std::make_shared<testing::BlockStackImpl>(2, ctx.rank == 0 ? 16 : 8);
      ADD_FAILURE() << "different models were sharded";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "ShardedConstruction (a FullyShard unit): the model "
                                              "differs across ranks at parameter #0: rank 0 has"))
          << e.what();
    }
    std::shared_ptr<testing::BlockStackImpl> model;
    {
      ShardedConstruction sharded(ctx.group);
      model = std::make_shared<testing::BlockStackImpl>();
    }
    try {
      model->blocks[0]->forward(x);
      ADD_FAILURE() << "a unit sharded at construction ran without FSDP";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "this unit was sharded as it was constructed"));
    }
    auto other = create_process_group("tcp", std::make_shared<PrefixStore>("other", ctx.store), ctx.rank,
                                      ctx.world, GroupOptions().name("other").timeout(30s));
    try {
      FullyShardedDataParallel fsdp(model, FSDPOptions().process_group(other));
      ADD_FAILURE() << "FSDP over another group adopted the units";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "was sharded at construction over group"));
      EXPECT_TRUE(testing::Contains(e.what(), "group 'other'"));
    }
  });
  testing::expect_no_errors(errors);
}

}  // namespace
}  // namespace dtrain
