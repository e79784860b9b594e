// Training across slow links (dtrain/local_sgd.h) with thread ranks:
// post-local SGD and DiLoCo against the algorithms computed here, replica
// by replica, in one thread; H = 1 against DDP; bad input named.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "dtrain/checkpoint/distributed.h"
#include "dtrain/ddp.h"
#include "dtrain/device_mesh.h"
#include "dtrain/fsdp.h"
#include "dtrain/local_sgd.h"
#include "dtrain/store/prefix_store.h"
#include "harness/assertions.h"
#include "harness/local_sgd_model.h"
#include "harness/temp_dir.h"
#include "harness/thread_ranks.h"

namespace dtrain::local_sgd_test {  // (a namespace of its own: the test binary is a unity build)
namespace {

using namespace std::chrono_literals;
using testing::RankContext;
using testing::run_rank_contexts;

using testing::local_sgd_model::batch;
using testing::local_sgd_model::loss_of;
using testing::local_sgd_model::Net;
using testing::local_sgd_model::values_of;

void expect_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want, double bound,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LE((got[i] - want[i]).abs().max().item<double>(), bound) << what << ": parameter " << i << "\n"
                                                                    << got[i] << "\n" << want[i];
}

// ---- post-local SGD -------------------------------------------------------------

// PyTorch's rule: the call numbered warmup_steps averages, then every
// period-th; a parameter without a gradient is left alone.
TEST(PeriodicModelAverager, AveragesAtWarmupThenEveryPeriodAndSkipsParametersWithoutGradients) {
  testing::expect_no_errors(run_rank_contexts(2, [](RankContext& ctx) {
    local_sgd::PeriodicModelAverager averager(4, 3, ctx.group);
    auto p = torch::zeros({2}).requires_grad_(true), idle = torch::zeros({2}).requires_grad_(true);
    p.mutable_grad() = torch::zeros({2});
    for (int call = 0; call < 12; ++call) {
      torch::NoGradGuard no_grad;
      p.fill_(10.0 * ctx.rank + call);
      idle.fill_(10.0 * ctx.rank + call);
      averager.average_parameters({p, idle});
      const bool due = call == 3 || call == 7 || call == 11;
      EXPECT_EQ(p[0].item<double>(), due ? 5.0 + call : 10.0 * ctx.rank + call) << "call " << call;
      EXPECT_EQ(idle[0].item<double>(), 10.0 * ctx.rank + call) << "no gradient: not averaged";
    }
    EXPECT_EQ(averager.step(), 12);
  }, 30s));
  EXPECT_EQ(testing::what_thrown<InvalidArgument>([] { local_sgd::PeriodicModelAverager(0); }),
            "PeriodicModelAverager: period must be at least 1, got 0");
}

// DDP with post_local_sgd_hook (gradients averaged for 10 steps, then each
// replica's own) and SGD with momentum under PostLocalSGDOptimizer
// (parameters averaged at step 10 and every 4th after): 50 steps on 2 and
// 4 ranks equal the same computed replica by replica within 1e-6.
class PostLocalSgd : public ::testing::TestWithParam<int> {};

TEST_P(PostLocalSgd, EqualsTheAlgorithmReplicaByReplica) {
  const int world = GetParam();
  constexpr int kSteps = 50, kStart = 10, kPeriod = 4;
  // The reference: `world` nets and optimizers in this thread.
  std::vector<Net> nets;
  std::vector<std::unique_ptr<torch::optim::SGD>> opts;
  for (int r = 0; r < world; ++r) {
    nets.emplace_back();
    opts.push_back(std::make_unique<torch::optim::SGD>(nets[r]->parameters(),
                                                       torch::optim::SGDOptions(0.05).momentum(0.9)));
  }
  const size_t count = nets[0]->parameters().size();
  for (int step = 0; step < kSteps; ++step) {
    for (int r = 0; r < world; ++r) {
      opts[r]->zero_grad();
      loss_of(nets[r], r, step).backward();
    }
    torch::NoGradGuard no_grad;
    if (step < kStart)
      for (size_t i = 0; i < count; ++i) {
        auto sum = torch::zeros_like(nets[0]->parameters()[i]);
        for (int r = 0; r < world; ++r) sum += nets[r]->parameters()[i].grad() / world;
        for (int r = 0; r < world; ++r) nets[r]->parameters()[i].mutable_grad().copy_(sum);
      }
    for (int r = 0; r < world; ++r) opts[r]->step();
    if (step >= kStart && (step - kStart) % kPeriod == 0)
      for (size_t i = 0; i < count; ++i) {
        auto sum = torch::zeros_like(nets[0]->parameters()[i]);
        for (int r = 0; r < world; ++r) sum += nets[r]->parameters()[i] / world;
        for (int r = 0; r < world; ++r) nets[r]->parameters()[i].copy_(sum);
      }
  }
  std::vector<std::vector<torch::Tensor>> want;
  for (auto& net : nets) want.push_back(values_of(net));

  testing::expect_no_errors(run_rank_contexts(world, [&](RankContext& ctx) {
    Net net;
    DistributedDataParallel ddp(net.ptr(), DDPOptions().process_group(ctx.group));
    ddp.register_comm_hook(local_sgd::post_local_sgd_hook(
        local_sgd::PostLocalSGDState().start_local_sgd_iter(kStart).post_local_gradient_allreduce(false)));
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    local_sgd::PeriodicModelAverager averager(kPeriod, kStart, ctx.group);
    local_sgd::PostLocalSGDOptimizer opt(sgd, averager);
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      auto [x, y] = batch(ctx.rank, step);
      (ddp.forward(x) - y).pow(2).mean().backward();
      opt.step();
    }
    expect_close(values_of(net), want[ctx.rank], 1e-6, "rank " + std::to_string(ctx.rank));
  }, 60s));
}

INSTANTIATE_TEST_SUITE_P(Ranks, PostLocalSgd, ::testing::Values(2, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// ---- DiLoCo ---------------------------------------------------------------------

struct Schedule {
  int64_t h = 4, delay = 0;
  double alpha = 0;
  int fragments = 1;
};

// DiLoCo and Streaming DiLoCo computed replica by replica: inner AdamW,
// outer SGD with Nesterov momentum over the global values; fragment i
// (layer a, then b) prepared at steps offset_i + k H (its pseudo-gradient
// global - own, averaged), applied `delay` steps later: the outer step on
// the global values, the fragment becoming (1 - alpha) global + alpha own.
std::vector<std::vector<torch::Tensor>> diloco_reference(int world, int steps, const Schedule& s) {
  std::vector<Net> nets;
  std::vector<std::unique_ptr<torch::optim::AdamW>> inner;
  for (int r = 0; r < world; ++r) {
    nets.emplace_back();
    inner.push_back(std::make_unique<torch::optim::AdamW>(nets[r]->parameters(), torch::optim::AdamWOptions(1e-2)));
  }
  Net global;  // the global values, stepped by the outer optimizer
  torch::optim::SGD outer(global->parameters(), torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
  auto fragment_of = [&](Net& n, int f) {
    if (s.fragments == 1) return n->parameters();
    return f == 0 ? n->a->parameters() : n->b->parameters();
  };
  std::vector<std::vector<torch::Tensor>> pending(s.fragments);  // averaged pseudo-gradients in flight
  for (int64_t step = 1; step <= steps; ++step) {
    for (int r = 0; r < world; ++r) {
      inner[r]->zero_grad();
      loss_of(nets[r], r, static_cast<int>(step - 1)).backward();
      inner[r]->step();
    }
    torch::NoGradGuard no_grad;
    for (int f = 0; f < s.fragments; ++f) {
      const int64_t offset = s.h * (f + 1) / s.fragments;
      if (step >= offset && (step - offset) % s.h == 0) {
        auto g = fragment_of(global, f);
        pending[f].clear();
        for (size_t i = 0; i < g.size(); ++i) {
          auto avg = torch::zeros_like(g[i]);
          for (int r = 0; r < world; ++r) avg += (g[i] - fragment_of(nets[r], f)[i]) / world;
          pending[f].push_back(avg);
        }
      }
    }
    for (int f = 0; f < s.fragments; ++f) {
      const int64_t offset = s.h * (f + 1) / s.fragments;
      if (step < offset + s.delay || (step - offset - s.delay) % s.h != 0) continue;
      for (auto& p : global->parameters()) p.mutable_grad() = torch::Tensor();
      auto g = fragment_of(global, f);
      for (size_t i = 0; i < g.size(); ++i) g[i].mutable_grad() = pending[f][i].clone();
      outer.step();
      for (int r = 0; r < world; ++r) {
        auto mine = fragment_of(nets[r], f);
        for (size_t i = 0; i < g.size(); ++i) mine[i].copy_(g[i] + s.alpha * (mine[i] - g[i]));
      }
    }
  }
  std::vector<std::vector<torch::Tensor>> out;
  for (auto& net : nets) out.push_back(values_of(net));
  return out;
}

// The same on thread ranks, each replica one rank.
void expect_diloco_equals_reference(int world, int steps, const Schedule& s) {
  const auto want = diloco_reference(world, steps, s);
  testing::expect_no_errors(run_rank_contexts(world, [&](RankContext& ctx) {
    Net net;
    torch::optim::AdamW inner(net->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::SGD outer(net->parameters(), torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
    std::vector<std::vector<torch::Tensor>> fragments{net->parameters()};
    if (s.fragments == 2) fragments = {net->a->parameters(), net->b->parameters()};
    local_sgd::DiLoCo diloco(fragments, inner, outer,
                             local_sgd::DiLoCoOptions().sync_every(s.h).sync_delay(s.delay).fragment_update_alpha(
                                 s.alpha).group(ctx.group));
    for (int step = 0; step < steps; ++step) {
      inner.zero_grad();
      loss_of(net, ctx.rank, step).backward();
      diloco.step();
    }
    expect_close(values_of(net), want[ctx.rank], 1e-6, "rank " + std::to_string(ctx.rank));
    EXPECT_EQ(diloco.local_step(), steps);
    if (s.fragments == 2) {
      const int64_t a_bytes = (4 * 6 + 6) * 4, b_bytes = (6 * 2 + 2) * 4;
      EXPECT_EQ(diloco.peak_sync_bytes(), std::max(a_bytes, b_bytes)) << "one fragment's pseudo-gradients";
    }
  }, 60s));
}

TEST(DiLoCo, TwoAndFourReplicasEqualThePapersAlgorithm) {
  expect_diloco_equals_reference(2, 20, Schedule{});
  expect_diloco_equals_reference(4, 20, Schedule{});
}

TEST(StreamingDiLoCo, FragmentsSyncAtStaggeredStepsWithDelayAndMixingAsComputedByHand) {
  expect_diloco_equals_reference(2, 21, Schedule{4, 1, 0.5, 2});
  expect_diloco_equals_reference(2, 21, Schedule{4, 0, 0.0, 2});
}

// The same model with each layer an FSDP unit.
using ShardedLinear = FullyShard<torch::nn::LinearImpl>;
struct ShardedNetImpl : torch::nn::Module {
  ShardedNetImpl() {
    a = register_module("a", std::make_shared<ShardedLinear>(4, 6));
    b = register_module("b", std::make_shared<ShardedLinear>(6, 2));
    testing::local_sgd_model::set_formula_values(*this);
  }
  torch::Tensor forward(torch::Tensor x) { return b->forward(torch::tanh(a->forward(x))); }
  std::shared_ptr<ShardedLinear> a, b;
};

// FSDP inside each replica: 2 replicas of 2 ranks sharding the model
// (FSDP over a mesh's "shard" dimension), DiLoCo over its "replicate"
// dimension on the shards, each unit's shard a fragment of Streaming
// DiLoCo. Both ranks of a replica train on the replica's batch (their
// averaged gradient is the replica's), so the full parameters must be the
// algorithm's, replica by replica, and the bytes of a sync half a
// fragment's.
TEST(DiLoCo, FsdpInsideEachReplicaEqualsThePapersAlgorithm) {
  for (const Schedule& s : {Schedule{}, Schedule{4, 1, 0.5, 2}}) {
    const int steps = 21;
    const auto want = diloco_reference(2, steps, s);
    testing::expect_no_errors(run_rank_contexts(4, [&](RankContext& ctx) {
      auto mesh = DeviceMesh({2, 2}, {"replicate", "shard"}, testing::thread_mesh(ctx));
      const int replica = mesh.get_local_rank("replicate");
      FullyShardedDataParallel fsdp(std::make_shared<ShardedNetImpl>(),
                                    FSDPOptions().process_group(mesh.get_group("shard")));
      torch::optim::AdamW inner(fsdp.parameters(), torch::optim::AdamWOptions(1e-2));
      torch::optim::SGD outer(fsdp.parameters(), torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
      const auto shards = fsdp.parameters();
      const auto units = fsdp.unit_names();
      std::vector<std::vector<torch::Tensor>> fragments(s.fragments);
      for (size_t i = 0; i < shards.size(); ++i)
        fragments[s.fragments == 2 && units[i] == "b" ? 1 : 0].push_back(shards[i]);
      local_sgd::DiLoCo diloco(fragments, inner, outer,
                               local_sgd::DiLoCoOptions().sync_every(s.h).sync_delay(s.delay).fragment_update_alpha(
                                   s.alpha).group(mesh.get_group("replicate")));
      for (int step = 0; step < steps; ++step) {
        inner.zero_grad();
        auto [x, y] = batch(replica, step);
        (fsdp.forward(x) - y).pow(2).mean().backward();
        diloco.step();
      }
      const auto full = fsdp.full_state_dict();
      const std::vector<torch::Tensor> got{full.at("a.weight"), full.at("a.bias"), full.at("b.weight"),
                                           full.at("b.bias")};
      expect_close(got, want[replica], 1e-6, "rank " + std::to_string(ctx.rank));
      if (s.fragments == 2) {
        const int64_t a_half = (4 * 6 + 6) / 2 * 4, b_half = (6 * 2 + 2) / 2 * 4;
        EXPECT_EQ(diloco.peak_sync_bytes(), std::max(a_half, b_half)) << "half a fragment's pseudo-gradients";
      }
    }, 60s));
  }
}

// bf16_exchange: the pseudo-gradients cross in bfloat16, half the bytes of
// a sync; after 20 steps the parameters are within bfloat16's rounding of
// the float32 exchange's (8 bits of mantissa: 4e-3 relative), and the
// replicas agree bitwise.
TEST(DiLoCo, ABf16ExchangeHalvesTheBytesWithinBf16sRoundingOfFloat32) {
  std::vector<std::vector<std::vector<torch::Tensor>>> values(2, std::vector<std::vector<torch::Tensor>>(2));
  std::vector<int64_t> bytes(2);
  for (int bf16 = 0; bf16 < 2; ++bf16)
    testing::expect_no_errors(run_rank_contexts(2, [&](RankContext& ctx) {
      Net net;
      torch::optim::AdamW inner(net->parameters(), torch::optim::AdamWOptions(1e-2));
      torch::optim::SGD outer(net->parameters(), torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
      local_sgd::DiLoCo diloco({net->parameters()}, inner, outer,
                               local_sgd::DiLoCoOptions().sync_every(4).bf16_exchange(bf16 == 1).group(ctx.group));
      for (int step = 0; step < 20; ++step) {
        inner.zero_grad();
        loss_of(net, ctx.rank, step).backward();
        diloco.step();
      }
      values[bf16][ctx.rank] = values_of(net);
      if (ctx.rank == 0) bytes[bf16] = diloco.peak_sync_bytes();
    }, 60s));
  EXPECT_EQ(bytes[0], (4 * 6 + 6 + 6 * 2 + 2) * 4);
  EXPECT_EQ(bytes[1], bytes[0] / 2);
  expect_close(values[1][1], values[1][0], 0, "bf16: the replicas agree");
  expect_close(values[1][0], values[0][0], 4e-3, "bf16 against float32");
  double moved = 0;
  for (size_t i = 0; i < values[1][0].size(); ++i)
    moved = std::max(moved, (values[1][0][i] - values[0][0][i]).abs().max().item<double>());
  EXPECT_GT(moved, 0) << "the exchange was in bfloat16";
}

// H = 1 with inner SGD and an outer SGD step of rate 1 without momentum:
// each step averages the replicas' parameters after one SGD step each,
// which is DDP's step on the averaged gradient. Not bitwise: the
// pseudo-gradient global - (global - lr g) is lr g only up to the rounding
// of the replica's parameter, so each step may differ by an ulp (20 steps:
// at most 3e-7 on values about 0.5).
TEST(DiLoCo, SyncingEveryStepWithAnOuterRateOfOneIsDdp) {
  constexpr int kSteps = 20;
  std::vector<std::vector<torch::Tensor>> ddp_values(2), diloco_values(2);
  testing::expect_no_errors(run_rank_contexts(2, [&](RankContext& ctx) {
    Net net;
    DistributedDataParallel ddp(net.ptr(), DDPOptions().process_group(ctx.group));
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05));
    for (int step = 0; step < kSteps; ++step) {
      sgd.zero_grad();
      auto [x, y] = batch(ctx.rank, step);
      (ddp.forward(x) - y).pow(2).mean().backward();
      sgd.step();
    }
    ddp_values[ctx.rank] = values_of(net);
  }, 60s));
  testing::expect_no_errors(run_rank_contexts(2, [&](RankContext& ctx) {
    Net net;
    torch::optim::SGD inner(net->parameters(), torch::optim::SGDOptions(0.05));
    torch::optim::SGD outer(net->parameters(), torch::optim::SGDOptions(1.0));
    local_sgd::DiLoCo diloco({net->parameters()}, inner, outer, local_sgd::DiLoCoOptions().sync_every(1).group(ctx.group));
    for (int step = 0; step < kSteps; ++step) {
      inner.zero_grad();
      loss_of(net, ctx.rank, step).backward();
      diloco.step();
    }
    diloco_values[ctx.rank] = values_of(net);
  }, 60s));
  expect_close(diloco_values[0], ddp_values[0], 1e-6, "H = 1 against DDP");
  expect_close(diloco_values[1], diloco_values[0], 0, "the replicas agree bitwise");
}

// A replica's training objects, built once, and their checkpoint: its
// parameters, the inner and outer optimizers' states and DiLoCo's own.
struct Replica {
  explicit Replica(RankContext& ctx)
      : inner(net->parameters(), torch::optim::AdamWOptions(1e-2)),
        outer(net->parameters(), torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true)),
        diloco({net->a->parameters(), net->b->parameters()}, inner, outer,
               local_sgd::DiLoCoOptions().sync_every(4).sync_delay(1).fragment_update_alpha(0.5).group(ctx.group)) {
    checkpoint::add_module(state, *net);
    checkpoint::add_optimizer(state, inner, *net, "inner/");
    checkpoint::add_optimizer(state, outer, *net, "outer/");
    checkpoint::add_diloco(state, diloco);
    // Each replica saves alone: a group of its one rank.
    self = testing::create_test_group("tcp", std::make_shared<PrefixStore>("self-" + std::to_string(ctx.rank), ctx.store),
                                      0, 1, GroupOptions());
  }
  void train(RankContext& ctx, int from, int to) {
    for (int step = from; step < to; ++step) {
      inner.zero_grad();
      loss_of(net, ctx.rank, step).backward();
      diloco.step();
    }
  }
  Net net;
  torch::optim::AdamW inner;
  torch::optim::SGD outer;
  local_sgd::DiLoCo diloco;
  checkpoint::DistributedState state;
  std::shared_ptr<ProcessGroup> self;
};

// Streaming DiLoCo (2 fragments, H 4, delay 1, mixing 0.5) saved after step
// 6, while fragment 0's average (taken at step 6, applied at 7) is in
// flight, and again after step 14 by the same state; new objects loading
// the step-6 checkpoint train on to step 21 bitwise as the run that never
// stopped.
TEST(DiLoCo, ACheckpointTakenWithAnAverageInFlightResumesBitwise) {
  testing::TempDir dir;
  std::vector<std::vector<torch::Tensor>> straight(2), resumed(2);
  testing::expect_no_errors(run_rank_contexts(2, [&](RankContext& ctx) {
    const std::string mine = dir.path() + "/replica-" + std::to_string(ctx.rank);
    {
      Replica r(ctx);
      r.train(ctx, 0, 6);
      checkpoint::save(mine, r.state, checkpoint::SaveOptions().process_group(r.self));
      r.train(ctx, 6, 14);
      checkpoint::save(mine + "-14", r.state, checkpoint::SaveOptions().process_group(r.self));
      r.train(ctx, 14, 21);
      straight[ctx.rank] = values_of(r.net);
    }
    Replica again(ctx);
    checkpoint::load(mine, again.state);
    EXPECT_EQ(again.diloco.local_step(), 6);
    again.train(ctx, 6, 21);
    resumed[ctx.rank] = values_of(again.net);
  }, 60s));
  for (int r = 0; r < 2; ++r) expect_close(resumed[r], straight[r], 0, "replica " + std::to_string(r));
}

TEST(DiLoCo, BadInputIsNamedOnEveryReplica) {
  testing::expect_no_errors(run_rank_contexts(2, [](RankContext& ctx) {
    Net net;
    torch::optim::AdamW inner(net->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::SGD outer(net->parameters(), torch::optim::SGDOptions(0.7));
    auto options = local_sgd::DiLoCoOptions().sync_every(4).group(ctx.group);
    using local_sgd::DiLoCo;
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                DiLoCo({net->a->parameters(), net->parameters()}, inner, outer, options);
              }),
              "DiLoCo: a parameter of shape [6, 4] is in fragment 0 and in fragment 1: the fragments must partition "
              "the parameters");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { DiLoCo({net->a->parameters()}, inner, outer, options); }),
              "DiLoCo: the inner optimizer holds 2 parameters that no fragment holds (they would drift apart across "
              "replicas): the fragments must partition its parameters");
    torch::optim::SGD other(net->a->parameters(), torch::optim::SGDOptions(0.7));
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { DiLoCo({net->parameters()}, inner, other, options); }),
              "DiLoCo: the fragments hold 2 parameters that the outer optimizer does not: both optimizers must hold "
              "exactly the fragments' parameters");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                DiLoCo({net->parameters()}, inner, outer, local_sgd::DiLoCoOptions().sync_every(4).sync_delay(4));
              }),
              "DiLoCo: sync_delay 4 must be in 0..sync_every - 1 (3): a fragment's average must end before its next "
              "one starts");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                DiLoCo({net->parameters()}, inner, outer, options.fragment_update_alpha(1.5));
              }),
              "DiLoCo: fragment_update_alpha 1.5 must be in [0, 1]");
    // Replicas that would sync at different steps: named on both.
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                DiLoCo({net->parameters()}, inner, outer,
                       local_sgd::DiLoCoOptions().sync_every(ctx.rank == 0 ? 32 : 16).group(ctx.group));
              }),
              "DiLoCo: the replicas differ: replica 1 has sync_every 16, replica 0 has 32 (every replica must sync "
              "the same fragments at the same steps)");
  }, 30s));
}

}  // namespace
}  // namespace dtrain::local_sgd_test
