// FullyShardedDataParallel: training on shards equals DDP with the same
// optimizer over all parameters (MLP, convnet in a Sequential, a stack of
// attention blocks with nested units; 2, 3 and 4 ranks), parameters hold
// memory only while their unit computes, gradients end up only in the
// shards, and the state dict, no_sync, clipping, summoning, mixed
// precision and error paths behave as PyTorch's FSDP.

#include <gtest/gtest.h>
#include <torch/torch.h>

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

constexpr int kFsdpBatch = 4;

template <typename Impl>
torch::Tensor inputs(int64_t n) {
  if constexpr (std::is_same_v<Impl, testing::ShardedConvNetImpl>) return torch::randn({n, 1, 8, 8});
  if constexpr (std::is_same_v<Impl, testing::BlockStackImpl>) return torch::randn({n, 3, 10});
  return torch::randn({n, 10});
}

using testing::Batch;

template <typename Impl>
std::vector<Batch> batches(int64_t rows, int steps) {
  torch::manual_seed(1234);
  std::vector<Batch> out;
  for (int s = 0; s < steps; ++s) out.push_back({inputs<Impl>(rows), torch::randn({rows, 4})});
  return out;
}

// One model per rank, all alike (built on this thread: the RNG is global).
template <typename Impl>
std::vector<std::shared_ptr<Impl>> models(int world, int seed = 0) {
  std::vector<std::shared_ptr<Impl>> out;
  for (int r = 0; r < world; ++r) {
    torch::manual_seed(seed);
    out.push_back(std::make_shared<Impl>());
  }
  return out;
}

using testing::kAdam;
using testing::kSgdMomentum;
using testing::MakeOptimizer;
// For attention: its query/key gradients start tiny and cancel, so their
// rounding differs between summation orders by a relative 1e-3; Adam turns
// any gradient into a step of about lr, so the steps differ by lr * 1e-3.
// Transformers train at this lr anyway.
const MakeOptimizer kTransformerAdam = [](std::vector<torch::Tensor> p) {
  return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-3).weight_decay(1e-3));
};

std::shared_ptr<ProcessGroup> second_group(RankContext& ctx, const std::string& backend = "tcp") {
  return create_process_group(backend, std::make_shared<PrefixStore>("fsdp", ctx.store), ctx.rank,
                              ctx.world, GroupOptions().name("fsdp").timeout(60s));
}

// Every entry of `full` equals the same-named parameter of `reference`.
void expect_equal_to(const std::map<std::string, at::Tensor>& full, torch::nn::Module& reference,
                     int rank, double rtol = 1e-5, double atol = 1e-6) {
  size_t compared = 0;
  for (const auto& item : reference.named_parameters()) {
    auto it = full.find(item.key());
    ASSERT_NE(it, full.end()) << "rank " << rank << ": no '" << item.key() << "' in the state";
    EXPECT_TRUE(torch::allclose(it->second, item.value(), rtol, atol))
        << "rank " << rank << " '" << item.key() << "' max diff "
        << (it->second - item.value()).abs().max().item<double>();
    ++compared;
  }
  EXPECT_EQ(compared, reference.named_parameters().size());
}

template <typename Impl>
void expect_fsdp_equals_ddp(int world, const MakeOptimizer& make, FSDPOptions options = {},
                            int steps = 10, const std::string& backend = "tcp") {
  auto data = batches<Impl>(world * kFsdpBatch, steps);
  auto plain = models<Impl>(world), sharded = models<Impl>(world);
  auto errors = run_rank_contexts(world, [&](RankContext& ctx) {
    const int r = ctx.rank;
    DistributedDataParallel ddp(plain[r], DDPOptions().process_group(ctx.group));
    FullyShardedDataParallel fsdp(sharded[r], FSDPOptions(options).process_group(second_group(ctx, backend)));
    auto opt_ddp = make(ddp.parameters());
    auto opt_fsdp = make(fsdp.parameters());
    for (int s = 0; s < steps; ++s) {
      auto x = data[s].x.narrow(0, r * kFsdpBatch, kFsdpBatch), y = data[s].y.narrow(0, r * kFsdpBatch, kFsdpBatch);
      opt_ddp->zero_grad();
      torch::mse_loss(ddp.forward(x), y).backward();
      opt_ddp->step();
      opt_fsdp->zero_grad();
      torch::mse_loss(fsdp.forward(x), y).backward();
      opt_fsdp->step();
    }
    expect_equal_to(fsdp.full_state_dict(), *plain[r], r);
  }, 120s);
  testing::expect_no_errors(errors);
}

class FsdpWorlds : public ::testing::TestWithParam<int> {};

TEST_P(FsdpWorlds, MlpWithAdamMatchesDdp) {
  expect_fsdp_equals_ddp<testing::ShardedMLPImpl>(GetParam(), kAdam);
}
TEST_P(FsdpWorlds, ConvNetInSequentialWithSgdMomentumMatchesDdp) {
  expect_fsdp_equals_ddp<testing::ShardedConvNetImpl>(GetParam(), kSgdMomentum);
}
TEST_P(FsdpWorlds, NestedAttentionBlocksWithAdamMatchDdp) {
  expect_fsdp_equals_ddp<testing::BlockStackImpl>(GetParam(), kTransformerAdam);
}
INSTANTIATE_TEST_SUITE_P(Fsdp, FsdpWorlds, ::testing::Values(2, 3, 4));

TEST(Fsdp, WithoutPrefetchOrReshardingStillMatchesDdp) {
  expect_fsdp_equals_ddp<testing::BlockStackImpl>(
      3, kTransformerAdam, FSDPOptions().forward_prefetch(false).backward_prefetch(false).reshard_after_forward(false));
}

TEST(Fsdp, OnTheShmBackendMatchesDdp) {
  expect_fsdp_equals_ddp<testing::BlockStackImpl>(2, kSgdMomentum, FSDPOptions(), 10, "shm");
}

// Units, their order and their shards: ceil(numel / world) elements each.
TEST(Fsdp, EachRankKeepsOneBalancedShardPerUnit) {
  auto nets = models<testing::BlockStackImpl>(3);
  auto errors = run_rank_contexts(3, [&](RankContext& ctx) {
    FullyShardedDataParallel fsdp(nets[ctx.rank], FSDPOptions().process_group(ctx.group));
    const std::vector<std::string> expected{"", "block0", "block0.attn", "block0.ff",
                                            "block1", "block1.attn", "block1.ff"};
    EXPECT_EQ(fsdp.unit_names(), expected);
    // root: proj 10*16+16, head 16*4+4; block: two layer norms; attn: 4 linear 16x16,
    // 3 biases; ff: 16*32+32 + 32*16+16.
    const std::vector<int64_t> numel{176 + 68, 64, 4 * 256 + 48, 1072, 64, 4 * 256 + 48, 1072};
    const auto shards = fsdp.parameters();
    ASSERT_EQ(shards.size(), numel.size());
    for (size_t u = 0; u < numel.size(); ++u) {
      EXPECT_EQ(shards[u].numel(), (numel[u] + 2) / 3) << expected[u];
      EXPECT_TRUE(shards[u].requires_grad());
      EXPECT_TRUE(shards[u].is_leaf());
    }
  });
  testing::expect_no_errors(errors);
}

bool holds_memory(const at::Tensor& t) { return t.storage().nbytes() > 0; }

// After forward only the root unit is gathered; after backward nothing is,
// the module's parameters have no .grad and each shard has its gradient.
TEST(Fsdp, ParametersHoldMemoryOnlyWhileTheirUnitComputes) {
  auto nets = models<testing::ShardedMLPImpl>(2);
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    auto& net = *nets[ctx.rank];
    FullyShardedDataParallel fsdp(nets[ctx.rank], FSDPOptions().process_group(ctx.group));
    for (const auto& p : net.parameters()) EXPECT_FALSE(holds_memory(p)) << "after construction";
    auto loss = fsdp.forward(torch::randn({kFsdpBatch, 10})).sum();
    EXPECT_FALSE(holds_memory(net.l1->fc->weight));
    EXPECT_FALSE(holds_memory(net.l2->fc->weight));
    EXPECT_TRUE(holds_memory(net.head->weight)) << "the root stays for backward";
    loss.backward();
    for (const auto& item : net.named_parameters()) {
      EXPECT_FALSE(holds_memory(item.value())) << item.key() << " after backward";
      EXPECT_FALSE(item.value().grad().defined()) << item.key() << " kept a full gradient";
    }
    for (const auto& shard : fsdp.parameters()) {
      ASSERT_TRUE(shard.grad().defined());
      EXPECT_EQ(shard.grad().sizes(), shard.sizes());
    }
    // Evaluation: no gradients, nothing stays gathered.
    {
      torch::NoGradGuard no_grad;
      fsdp.forward(torch::randn({kFsdpBatch, 10}));
    }
    for (const auto& p : net.parameters()) EXPECT_FALSE(holds_memory(p)) << "after evaluation";
  });
  testing::expect_no_errors(errors);
}

// Stats of the third iteration of a 2-block stack (7 units): each unit is
// gathered for forward, the six non-root units again for backward, many of
// them ahead of need; all are reduced; at most a few units are full at once.
TEST(Fsdp, StatsShowPrefetchingAndBoundedGatheredMemory) {
  auto nets = models<testing::BlockStackImpl>(2), more = models<testing::BlockStackImpl>(2);
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    auto run = [&](std::shared_ptr<testing::BlockStackImpl> net, FSDPOptions options) {
      FullyShardedDataParallel fsdp(net, options.process_group(ctx.group));
      for (int i = 0; i < 3; ++i) fsdp.forward(torch::randn({kFsdpBatch, 3, 10})).sum().backward();
      return fsdp.stats();
    };
    const auto stats = run(nets[ctx.rank], FSDPOptions());
    EXPECT_EQ(stats.iteration, 3);
    EXPECT_EQ(stats.all_gathers, 7 + 6);
    EXPECT_EQ(stats.reduce_scatters, 7);
    EXPECT_GE(stats.prefetched, 8) << "forward: 6 units after the first; backward: 5 after the first";
    // Shards: 1/2 of every unit; full units: (244 + 2 * (64 + 1072 + 1072)) floats in all.
    EXPECT_EQ(stats.shard_bytes, 4 * (122 + 2 * (32 + 536 + 536)));
    const int64_t all_units = 4 * (244 + 2 * (64 + 1072 + 1072));
    EXPECT_LT(stats.peak_gathered_bytes, all_units * 2 / 3);
    // Unsharded gradients: a unit's flat buffer (and its reduced half) until
    // its reduce-scatter ends, which is finished before the next unit builds
    // its own: one unit's at once (the largest: 1072 floats, padded to
    // 1072, plus 536), not two, not all seven.
    EXPECT_GT(stats.peak_gradient_bytes, 0);
    EXPECT_LE(stats.peak_gradient_bytes, 4 * (1072 + 536));
    const auto kept = run(more[ctx.rank], FSDPOptions().reshard_after_forward(false).forward_prefetch(false));
    try {
      FullyShardedDataParallel again(nets[ctx.rank], FSDPOptions().process_group(ctx.group));
      ADD_FAILURE() << "a module whose parameters live in destroyed shards was wrapped again";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "parameter 'proj.weight' holds no memory: was its "
                                              "module already wrapped"));
    }
    EXPECT_EQ(kept.all_gathers, 7);
    EXPECT_EQ(kept.prefetched, 0);
    EXPECT_EQ(kept.peak_gathered_bytes, all_units);
  });
  testing::expect_no_errors(errors);
}

TEST(Fsdp, WithoutReshardAfterForwardUnitsStayUntilTheirGradientsAreReduced) {
  auto nets = models<testing::ShardedMLPImpl>(2);
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    auto& net = *nets[ctx.rank];
    FullyShardedDataParallel fsdp(
        nets[ctx.rank], FSDPOptions().process_group(ctx.group).reshard_after_forward(false));
    auto loss = fsdp.forward(torch::randn({kFsdpBatch, 10})).sum();
    EXPECT_TRUE(holds_memory(net.l1->fc->weight));
    loss.backward();
    EXPECT_FALSE(holds_memory(net.l1->fc->weight));
  });
  testing::expect_no_errors(errors);
}

// Two micro-batches, the first under no_sync, then one step: as DDP.
TEST(Fsdp, NoSyncAndGradientAccumulationMatchDdp) {
  constexpr int kWorld = 2, kSteps = 4;
  auto data = batches<testing::BlockStackImpl>(kWorld * kFsdpBatch, 3 * kSteps);
  auto plain = models<testing::BlockStackImpl>(kWorld), sharded = models<testing::BlockStackImpl>(kWorld);
  auto errors = run_rank_contexts(kWorld, [&](RankContext& ctx) {
    const int r = ctx.rank;
    DistributedDataParallel ddp(plain[r], DDPOptions().process_group(ctx.group));
    FullyShardedDataParallel fsdp(sharded[r], FSDPOptions().process_group(second_group(ctx)));
    auto opt_ddp = kTransformerAdam(ddp.parameters());
    auto opt_fsdp = kTransformerAdam(fsdp.parameters());
    auto slice = [&](int i) {
      return std::make_pair(data[i].x.narrow(0, r * kFsdpBatch, kFsdpBatch), data[i].y.narrow(0, r * kFsdpBatch, kFsdpBatch));
    };
    for (int s = 0; s < kSteps; ++s) {
      opt_ddp->zero_grad();
      opt_fsdp->zero_grad();
      auto [x0, y0] = slice(3 * s);
      {
        auto guard = ddp.no_sync();
        torch::mse_loss(ddp.forward(x0), y0).backward();
      }
      {
        auto guard = fsdp.no_sync();
        torch::mse_loss(fsdp.forward(x0), y0).backward();
      }
      for (int i = 1; i < 3; ++i) {  // two synchronized backward passes accumulate
        auto [x, y] = slice(3 * s + i);
        torch::mse_loss(ddp.forward(x), y).backward();
        torch::mse_loss(fsdp.forward(x), y).backward();
      }
      opt_ddp->step();
      opt_fsdp->step();
    }
    expect_equal_to(fsdp.full_state_dict(), *plain[r], r);
  }, 120s);
  testing::expect_no_errors(errors);
}

TEST(Fsdp, ClipGradNormMatchesClippingTheWholeModel) {
  constexpr int kWorld = 3;
  auto data = batches<testing::ShardedMLPImpl>(kWorld * kFsdpBatch, 5);
  auto plain = models<testing::ShardedMLPImpl>(kWorld), sharded = models<testing::ShardedMLPImpl>(kWorld);
  auto errors = run_rank_contexts(kWorld, [&](RankContext& ctx) {
    const int r = ctx.rank;
    DistributedDataParallel ddp(plain[r], DDPOptions().process_group(ctx.group));
    FullyShardedDataParallel fsdp(sharded[r], FSDPOptions().process_group(second_group(ctx)));
    auto opt_ddp = kSgdMomentum(ddp.parameters());
    auto opt_fsdp = kSgdMomentum(fsdp.parameters());
    for (int s = 0; s < 5; ++s) {
      auto x = data[s].x.narrow(0, r * kFsdpBatch, kFsdpBatch), y = data[s].y.narrow(0, r * kFsdpBatch, kFsdpBatch);
      opt_ddp->zero_grad();
      (10 * torch::mse_loss(ddp.forward(x), y)).backward();
      const double expected = torch::nn::utils::clip_grad_norm_(ddp.parameters(), 0.1);
      opt_ddp->step();
      opt_fsdp->zero_grad();
      (10 * torch::mse_loss(fsdp.forward(x), y)).backward();
      const double norm = fsdp.clip_grad_norm_(0.1);
      EXPECT_NEAR(norm, expected, 1e-5 * expected) << "rank " << r << " step " << s;
      EXPECT_GT(norm, 0.1) << "the test must clip";
      opt_fsdp->step();
    }
    expect_equal_to(fsdp.full_state_dict(), *plain[r], r);
  }, 120s);
  testing::expect_no_errors(errors);
}

TEST(Fsdp, FullStateDictRoundTripsAndUsesTheModulesNames) {
  auto nets = models<testing::BlockStackImpl>(2);
  torch::manual_seed(7);
  auto other = std::make_shared<testing::BlockStackImpl>();  // different values
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    FullyShardedDataParallel fsdp(nets[ctx.rank], FSDPOptions().process_group(ctx.group));
    std::map<std::string, at::Tensor> state;
    for (const auto& item : other->named_parameters()) state[item.key()] = item.value().detach();
    fsdp.load_full_state_dict(state);
    auto back = fsdp.full_state_dict();
    EXPECT_EQ(back.size(), state.size());
    expect_equal_to(back, *other, ctx.rank, 0, 0);
    auto only0 = fsdp.full_state_dict(/*rank0_only=*/true);
    EXPECT_EQ(only0.empty(), ctx.rank != 0);
    // The forward uses the loaded values.
    torch::NoGradGuard no_grad;
    auto x = torch::ones({2, 3, 10});
    EXPECT_TRUE(torch::allclose(fsdp.forward(x), other->forward(x), 1e-5, 1e-6));
  });
  testing::expect_no_errors(errors);
}

TEST(Fsdp, LoadingABadStateNamesTheProblemAndChangesNothing) {
  auto nets = models<testing::ShardedMLPImpl>(1);
  auto errors = run_rank_contexts(1, [&](RankContext& ctx) {
    FullyShardedDataParallel fsdp(nets[0], FSDPOptions().process_group(ctx.group));
    const auto good = fsdp.full_state_dict();
    auto expect_refused = [&](std::map<std::string, at::Tensor> state, const std::string& text) {
      try {
        fsdp.load_full_state_dict(state);
        ADD_FAILURE() << "accepted; expected: " << text;
      } catch (const InvalidArgument& e) {
        EXPECT_TRUE(testing::Contains(e.what(), text));
      }
      auto now = fsdp.full_state_dict();
      for (const auto& [name, value] : good) EXPECT_TRUE(torch::equal(now.at(name), value)) << name;
    };
    auto missing = good;
    missing.erase("l2.fc.bias");
    auto reshaped = good;
    reshaped["head.weight"] = torch::zeros({4, 31});
    auto extra = good;
    extra["l3.fc.weight"] = torch::zeros({1});
    expect_refused(missing, "load_full_state_dict: 'l2.fc.bias' is missing from the state");
    expect_refused(reshaped, "'head.weight' has shape [4, 31] in the state but [4, 32] in the module");
    expect_refused(extra, "the state has 'l3.fc.weight', which the module does not");
  });
  testing::expect_no_errors(errors);
}

TEST(Fsdp, SummonFullParamsShowsAndWritesBackTheParameters) {
  auto nets = models<testing::ShardedMLPImpl>(2);
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    auto& net = *nets[ctx.rank];
    FullyShardedDataParallel fsdp(nets[ctx.rank], FSDPOptions().process_group(ctx.group));
    const auto before = fsdp.full_state_dict();
    {
      auto full = fsdp.summon_full_params();
      EXPECT_TRUE(torch::equal(net.l2->fc->weight, before.at("l2.fc.weight")));
      torch::NoGradGuard no_grad;
      net.l2->fc->weight.fill_(0.5);
    }
    EXPECT_FALSE(holds_memory(net.l2->fc->weight));
    EXPECT_TRUE(torch::equal(fsdp.full_state_dict().at("l2.fc.weight"), torch::full({32, 32}, 0.5)));
    EXPECT_TRUE(torch::equal(fsdp.full_state_dict().at("l1.fc.weight"), before.at("l1.fc.weight")));
  });
  testing::expect_no_errors(errors);
}

// Records the dtype its parameters have while it computes.
struct ProbeImpl : testing::LinearReluImpl {
  ProbeImpl() : LinearReluImpl(10, 8) {}
  torch::Tensor forward(torch::Tensor x) {
    seen = fc->weight.scalar_type();
    return LinearReluImpl::forward(x);
  }
  at::ScalarType seen = at::kFloat;
};
struct ProbeNetImpl : torch::nn::Module {
  ProbeNetImpl() {
    probe = register_module("probe", std::make_shared<FullyShard<ProbeImpl>>());
    head = register_module("head", torch::nn::Linear(8, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return head(probe->forward(x)); }
  std::shared_ptr<FullyShard<ProbeImpl>> probe;
  torch::nn::Linear head{nullptr};
};

// bf16 compute and communication, fp32 shards: close to fp32 training.
TEST(Fsdp, MixedPrecisionComputesInBf16AndKeepsFp32Shards) {
  constexpr int kWorld = 2, kSteps = 10;
  auto data = batches<testing::ShardedMLPImpl>(kWorld * kFsdpBatch, kSteps);
  auto full = models<ProbeNetImpl>(kWorld), mixed = models<ProbeNetImpl>(kWorld);
  auto errors = run_rank_contexts(kWorld, [&](RankContext& ctx) {
    const int r = ctx.rank;
    FullyShardedDataParallel a(full[r], FSDPOptions().process_group(ctx.group));
    FullyShardedDataParallel b(mixed[r], FSDPOptions().process_group(second_group(ctx)).mixed_precision(
                                             MixedPrecision().param_dtype(at::kBFloat16)));
    auto opt_a = kSgdMomentum(a.parameters()), opt_b = kSgdMomentum(b.parameters());
    for (int s = 0; s < kSteps; ++s) {
      auto x = data[s].x.narrow(0, r * kFsdpBatch, kFsdpBatch), y = data[s].y.narrow(0, r * kFsdpBatch, kFsdpBatch);
      opt_a->zero_grad();
      torch::mse_loss(a.forward(x), y).backward();
      opt_a->step();
      opt_b->zero_grad();
      auto out = b.forward(x);
      EXPECT_EQ(out.scalar_type(), at::kBFloat16);
      torch::mse_loss(out.to(at::kFloat), y).backward();
      opt_b->step();
    }
    EXPECT_EQ(mixed[r]->probe->seen, at::kBFloat16);
    for (const auto& shard : b.parameters()) {
      EXPECT_EQ(shard.scalar_type(), at::kFloat);
      EXPECT_EQ(shard.grad().scalar_type(), at::kFloat);
    }
    auto sa = a.full_state_dict(), sb = b.full_state_dict();
    for (const auto& [name, value] : sa) {
      EXPECT_EQ(sb.at(name).scalar_type(), at::kFloat) << name;
      EXPECT_TRUE(torch::allclose(sb.at(name), value, 0.05, 0.02))
          << name << " max diff " << (sb.at(name) - value).abs().max().item<double>();
      EXPECT_FALSE(torch::equal(sb.at(name), value)) << name << ": bf16 made no difference";
    }
  }, 120s);
  testing::expect_no_errors(errors);
}

struct TiedImpl : torch::nn::Module {
  explicit TiedImpl(const torch::Tensor& w) : weight(register_parameter("weight", w)) {}
  torch::Tensor forward(torch::Tensor x) { return x.matmul(weight); }
  torch::Tensor weight;
};
struct SharedWeightNetImpl : torch::nn::Module {
  SharedWeightNetImpl() {
    auto w = torch::randn({4, 4});
    a = register_module("a", std::make_shared<FullyShard<TiedImpl>>(w));
    b = register_module("b", std::make_shared<FullyShard<TiedImpl>>(w));
  }
  torch::Tensor forward(torch::Tensor x) { return b->forward(a->forward(x)); }
  std::shared_ptr<FullyShard<TiedImpl>> a, b;
};

struct HalfFrozenImpl : torch::nn::Module {
  HalfFrozenImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(4, 4));
    fc2 = register_module("fc2", torch::nn::Linear(4, 4));
    fc2->weight.set_requires_grad(false);
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(fc1(x)); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

TEST(Fsdp, ParametersThatCannotShareAFlatBufferAreNamed) {
  auto errors = run_rank_contexts(1, [&](RankContext& ctx) {
    try {
      FullyShardedDataParallel fsdp(std::make_shared<SharedWeightNetImpl>(),
                                    FSDPOptions().process_group(ctx.group));
      ADD_FAILURE() << "a parameter shared by two units was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "parameter 'b.weight' is also 'a.weight': one "
                                              "parameter shared by units 'a' and 'b'"));
    }
    try {
      FullyShardedDataParallel fsdp(std::make_shared<HalfFrozenImpl>(),
                                    FSDPOptions().process_group(ctx.group));
      ADD_FAILURE() << "a unit with frozen and trainable parameters was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "in unit '', parameter 'fc2.weight'"));
      EXPECT_TRUE(testing::Contains(e.what(), "differ in requires_grad"));
    }
  });
  testing::expect_no_errors(errors);
}

// Outside a FullyShardedDataParallel a unit is its plain module.
TEST(Fsdp, AUnitOutsideFsdpIsItsPlainModule) {
  torch::manual_seed(0);
  auto unit = std::make_shared<FullyShard<testing::LinearReluImpl>>(3, 2);
  EXPECT_FALSE(unit->is_sharded());
  auto x = torch::randn({2, 3});
  EXPECT_TRUE(torch::equal(unit->forward(x), torch::relu(unit->fc(x))));
  EXPECT_EQ(unit->named_parameters().size(), 2u);
  EXPECT_TRUE(unit->named_parameters().contains("fc.weight"));
}

}  // namespace
}  // namespace dtrain
