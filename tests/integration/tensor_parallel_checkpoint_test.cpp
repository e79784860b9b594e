// Checkpoints of tensor-parallel layouts: the TP layers' parameters and
// Adam's state go in as boxes of the whole tensors, so a checkpoint saved
// at TP 4 loads bitwise into one process and into TP 2 x DDP 2, and both
// then train on alike; FSDP over TP layers saves the whole layers too and
// loads them back; boxes that overlap, do not cover their whole or lie
// outside it, and a whole of another shape are named.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "dtrain/checkpoint/distributed.h"
#include "dtrain/ddp.h"
#include "dtrain/device_mesh.h"
#include "dtrain/fsdp.h"
#include "dtrain/tensor_parallel.h"
#include "harness/assertions.h"
#include "harness/shards.h"
#include "harness/optimizer_values.h"
#include "harness/temp_dir.h"
#include "harness/thread_ranks.h"
#include "harness/tp_block.h"

namespace dtrain {
namespace {

namespace ckpt = checkpoint;
namespace tp = tensor_parallel;
using testing::RankContext;
using Params = testing::NamedTensors;

constexpr int64_t kCkptSeq = 4, kCkptHidden = 8, kCkptInner = 16;

using testing::exp_avg_of;
using testing::params_of;

ckpt::DistributedState block_state(torch::nn::Module& block, torch::optim::Optimizer& opt) {
  ckpt::DistributedState state;
  ckpt::add_module(state, block);
  ckpt::add_optimizer(state, opt, block);
  return state;
}

// Each of the ranks' tensors equals its TP shard of `whole`, bitwise.
void expect_shards_of(const Params& whole, const Params& mine, int t, int ranks, const std::string& what) {
  ASSERT_EQ(mine.size(), whole.size()) << what;
  for (const auto& [name, value] : mine)
    EXPECT_TRUE(at::equal(value, testing::block_shard(whole, name, t, ranks))) << what << ": " << name;
}

TEST(TensorParallelCheckpoint, SavedAtTp4ItLoadsBitwiseIntoOneProcessAndTp2TimesDdp2) {
  testing::TempDir dir;
  const auto init = testing::initial_block(kCkptHidden, kCkptInner);
  std::vector<at::Tensor> xs, ys;
  for (int step = 0; step < 3; ++step) {
    xs.push_back(torch::randn({4, kCkptSeq, kCkptHidden}));
    ys.push_back(torch::randn({4, kCkptSeq, kCkptHidden}));
  }
  // TP 4: two Adam steps, then save; every rank's parameters and exp_avg.
  std::vector<Params> saved_params(4), saved_moments(4);
  testing::expect_no_errors(testing::run_rank_contexts(4, [&](RankContext& ctx) {
    testing::TpBlock block(init, tp::ParallelLinearOptions().group(ctx.group));
    auto adam = testing::kAdam(block->parameters());
    for (int step = 0; step < 2; ++step) {
      adam->zero_grad();
      torch::mse_loss(block(xs[step]), ys[step]).backward();
      adam->step();
    }
    auto state = block_state(*block, *adam);
    EXPECT_EQ(state.sharded.size(), 9u) << "up's weight and bias and down's weight, and Adam's two moments of each";
    ckpt::save(dir.path(), state, ckpt::SaveOptions().process_group(ctx.group));
    saved_params[ctx.rank] = params_of(*block);
    saved_moments[ctx.rank] = exp_avg_of(*adam, *block);
  }));
  // One process, from other initial values: loads the whole tensors.
  testing::PlainBlock whole(testing::initial_block(kCkptHidden, kCkptInner, 99));
  auto whole_adam = testing::kAdam(whole->parameters());
  auto whole_state = block_state(*whole, *whole_adam);
  ckpt::load(dir.path(), whole_state);
  const Params loaded = params_of(*whole), loaded_moments = exp_avg_of(*whole_adam, *whole);
  ASSERT_EQ(loaded_moments.size(), 6u);
  for (int t = 0; t < 4; ++t) {
    expect_shards_of(loaded, saved_params[t], t, 4, "TP 4's rank " + std::to_string(t));
    expect_shards_of(loaded_moments, saved_moments[t], t, 4, "TP 4's rank " + std::to_string(t) + "'s exp_avg");
  }
  whole_adam->zero_grad();
  torch::mse_loss(whole(xs[2]), ys[2]).backward();
  whole_adam->step();
  const Params after = params_of(*whole);
  // TP 2 x DDP 2: loads its boxes, then one step on half the batch each.
  testing::expect_no_errors(testing::run_rank_contexts(4, [&](RankContext& ctx) {
    DeviceMesh mesh({2, 2}, {"dp", "tp"}, testing::thread_mesh(ctx));
    const int t = mesh.get_local_rank("tp"), d = mesh.get_local_rank("dp");
    testing::TpBlock block(testing::initial_block(kCkptHidden, kCkptInner, 99),
                           tp::ParallelLinearOptions().group(mesh.get_group("tp")));
    DistributedDataParallel<testing::TpBlockImpl> ddp(block.ptr(), DDPOptions().process_group(mesh.get_group("dp")));
    auto adam = testing::kAdam(block->parameters());
    auto state = block_state(*block, *adam);
    ckpt::load(dir.path(), state);
    expect_shards_of(loaded, params_of(*block), t, 2, "TP 2 x DDP 2 after loading");
    expect_shards_of(loaded_moments, exp_avg_of(*adam, *block), t, 2, "its exp_avg after loading");
    adam->zero_grad();
    torch::mse_loss(ddp.forward(xs[2].chunk(2)[d]), ys[2].chunk(2)[d]).backward();
    adam->step();
    for (const auto& [name, value] : params_of(*block))
      testing::expect_close(value, testing::block_shard(after, name, t, 2), name + " one step after loading");
  }));
}

TEST(TensorParallelCheckpoint, BadBoxesAreNamed) {
  testing::TempDir dir;
  auto save_boxes = [&](std::vector<int64_t> rows_from) {
    std::string error;
    testing::expect_no_errors(testing::run_rank_contexts(2, [&](RankContext& ctx) {
      ckpt::DistributedState state;
      state.sharded["w"] = ckpt::ShardedTensor::box(at::ones({2, 3}), {4, 3}, {rows_from[ctx.rank], 0});
      try {
        ckpt::save(dir.path(), state, ckpt::SaveOptions().process_group(ctx.group));
      } catch (const InvalidArgument& e) {
        if (ctx.rank == 0) error = e.what();
      }
    }));
    return error;
  };
  EXPECT_EQ(save_boxes({0, 1}), "checkpoint::save: the pieces of sharded 'w' overlap: [0:2, 0:3] on rank 0 "
                                "and [1:3, 0:3] on rank 1; ranks must hold the same piece or disjoint ones");
  EXPECT_EQ(save_boxes({2, 2}), "checkpoint::save: the ranks hold 6 of the 12 elements of sharded 'w'");
  EXPECT_EQ(save_boxes({0, 2}), "");  // two halves: saved
  ckpt::DistributedState outside;
  outside.sharded["w"] = ckpt::ShardedTensor::box(at::zeros({2, 3}), {4, 3}, {3, 0});
  EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { ckpt::load(dir.path(), outside); }),
            "checkpoint: sharded 'w' holds [3, 5) of dimension 0 of a whole of shape [4, 3]");
  ckpt::DistributedState other_shape;
  other_shape.sharded["w"] = ckpt::ShardedTensor::box(at::zeros({3, 2}), {3, 4}, {0, 0});
  EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { ckpt::load(dir.path(), other_shape); }),
            "checkpoint " + dir.path() + ": 'w' has shape [4, 3] in the checkpoint but [3, 4] here");
  ckpt::DistributedState flat;
  flat.sharded["w"] = ckpt::ShardedTensor{at::zeros({12}), 0, 12};
  EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { ckpt::load(dir.path(), flat); }),
            "checkpoint " + dir.path() + ": sharded 'w' was saved as boxes of a whole of shape [4, 3], and "
            "is asked for here as a flat range");
  at::Tensor whole = at::zeros({4, 3});  // a replicated request gets the whole
  ckpt::DistributedState replicated;
  replicated.replicated["w"] = whole;
  ckpt::load(dir.path(), replicated);
  EXPECT_TRUE(at::equal(whole, at::ones({4, 3})));
}

// Rank ctx.rank of a {dp 2, tp 2} mesh: FSDP over dp of a TP block over
// tp, with Adam; body(the ranks' group, tp rank, fsdp, adam, step(i) on
// xs[i] and ys[i]).
using FsdpTpBody = std::function<void(const std::shared_ptr<ProcessGroup>&, int,
                                      FullyShardedDataParallel<testing::TpBlockImpl>&,
                                      torch::optim::Optimizer&, const std::function<void(int)>&)>;
void run_fsdp_over_tp(const testing::BlockInit& values, const std::vector<at::Tensor>& xs,
                      const std::vector<at::Tensor>& ys, const FsdpTpBody& body) {
  testing::expect_no_errors(testing::run_rank_contexts(4, [&](RankContext& ctx) {
    DeviceMesh mesh({2, 2}, {"dp", "tp"}, testing::thread_mesh(ctx));
    const int d = mesh.get_local_rank("dp");
    testing::TpBlock block(values, tp::ParallelLinearOptions().group(mesh.get_group("tp")));
    FullyShardedDataParallel<testing::TpBlockImpl> fsdp(block.ptr(), FSDPOptions().process_group(mesh.get_group("dp")));
    auto adam = testing::kAdam(fsdp.parameters());
    auto step = [&](int i) {
      adam->zero_grad();
      torch::mse_loss(fsdp.forward(xs[i].chunk(2)[d]), ys[i].chunk(2)[d]).backward();
      adam->step();
    };
    body(ctx.group, mesh.get_local_rank("tp"), fsdp, *adam, step);
  }));
}

// TP 2 x FSDP 2: two Adam steps, saved. Each parameter and moment goes in
// whole (gathered over the FSDP group) as its TP box, so one process loads
// the whole layers bitwise; and a fresh TP 2 x FSDP 2 loads them back into
// its flat shards and then takes the step the one process takes.
TEST(TensorParallelCheckpoint, FsdpOverTpLayersSavesTheWholeLayersAndLoadsThemBack) {
  testing::TempDir dir;
  std::vector<at::Tensor> xs, ys;
  for (int step = 0; step < 3; ++step) {
    xs.push_back(torch::randn({4, kCkptSeq, kCkptHidden}));
    ys.push_back(torch::randn({4, kCkptSeq, kCkptHidden}));
  }
  std::mutex mu;
  std::vector<std::pair<int, Params>> saved;  // (TP rank, TP-local whole parameters) per rank
  run_fsdp_over_tp(testing::initial_block(kCkptHidden, kCkptInner), xs, ys, [&](auto& world, int t, auto& fsdp, auto& adam, auto& step) {
    step(0);
    step(1);
    ckpt::DistributedState state;
    ckpt::add_fsdp(state, fsdp, adam);
    EXPECT_EQ(state.sharded.size(), 9u) << "up's weight and bias and down's weight, and Adam's two moments of each";
    ckpt::save(dir.path(), state, ckpt::SaveOptions().process_group(world));
    auto mine = fsdp.full_state_dict();
    std::lock_guard<std::mutex> lock(mu);
    saved.emplace_back(t, std::move(mine));
  });
  testing::PlainBlock whole(testing::initial_block(kCkptHidden, kCkptInner, 99));
  auto whole_adam = testing::kAdam(whole->parameters());
  auto whole_state = block_state(*whole, *whole_adam);
  ckpt::load(dir.path(), whole_state);
  const Params loaded = params_of(*whole);
  ASSERT_EQ(saved.size(), 4u);
  for (const auto& [t, mine] : saved) expect_shards_of(loaded, mine, t, 2, "TP rank " + std::to_string(t));
  whole_adam->zero_grad();
  torch::mse_loss(whole(xs[2]), ys[2]).backward();
  whole_adam->step();
  const Params after = params_of(*whole);
  run_fsdp_over_tp(testing::initial_block(kCkptHidden, kCkptInner, 99), xs, ys, [&](auto& world, int t, auto& fsdp, auto& adam, auto& step) {
    ckpt::DistributedState state;
    ckpt::add_fsdp(state, fsdp, adam);
    (void)world;
    ckpt::load(dir.path(), state);
    expect_shards_of(loaded, fsdp.full_state_dict(), t, 2, "TP 2 x FSDP 2 after loading");
    step(2);
    for (const auto& [name, value] : fsdp.full_state_dict())
      testing::expect_close(value, testing::block_shard(after, name, t, 2), name + " one step after loading");
  });
}

// The state built once, before training, as a training loop builds it, and
// saved after each of two steps: each checkpoint holds the values of its
// save (every parameter, moment and step count: the one process that loads
// the second takes the third step as TP 2 x FSDP 2 does). Before, add_fsdp
// gathered the TP layers' parameters and moments once, at build: both
// checkpoints held the initial weights and zero moments.
TEST(TensorParallelCheckpoint, FsdpOverTpStateBuiltOnceSavesTheValuesOfEachSave) {
  testing::TempDir first, second;
  std::vector<at::Tensor> xs, ys;
  for (int step = 0; step < 3; ++step) {
    xs.push_back(torch::randn({4, kCkptSeq, kCkptHidden}));
    ys.push_back(torch::randn({4, kCkptSeq, kCkptHidden}));
  }
  std::mutex mu;
  std::map<int, Params> at_first, at_second, after_third;  // by TP rank (both DP ranks agree)
  run_fsdp_over_tp(testing::initial_block(kCkptHidden, kCkptInner), xs, ys, [&](auto& world, int t, auto& fsdp, auto& adam, auto& step) {
    ckpt::DistributedState state;
    ckpt::add_fsdp(state, fsdp, adam);
    const auto options = ckpt::SaveOptions().process_group(world);
    step(0);
    ckpt::save(first.path(), state, options);
    auto one = fsdp.full_state_dict();
    step(1);
    ckpt::save(second.path(), state, options);
    auto two = fsdp.full_state_dict();
    step(2);
    auto three = fsdp.full_state_dict();
    std::lock_guard<std::mutex> lock(mu);
    at_first[t] = std::move(one);
    at_second[t] = std::move(two);
    after_third[t] = std::move(three);
  });
  ASSERT_EQ(at_first.size(), 2u);
  for (const auto* dir : {&first, &second}) {
    testing::PlainBlock whole(testing::initial_block(kCkptHidden, kCkptInner, 99));
    auto whole_adam = testing::kAdam(whole->parameters());
    auto whole_state = block_state(*whole, *whole_adam);
    ckpt::load(dir->path(), whole_state);
    const bool is_first = dir == &first;
    const Params loaded = params_of(*whole);
    for (int t = 0; t < 2; ++t)
      expect_shards_of(loaded, is_first ? at_first[t] : at_second[t], t, 2,
                       std::string(is_first ? "the first" : "the second") + " save, TP rank " + std::to_string(t));
    if (is_first) continue;
    whole_adam->zero_grad();
    torch::mse_loss(whole(xs[2]), ys[2]).backward();
    whole_adam->step();
    const Params after = params_of(*whole);
    for (int t = 0; t < 2; ++t)
      for (const auto& [name, value] : after_third[t])
        testing::expect_close(value, testing::block_shard(after, name, t, 2),
                              name + " one step after loading the second save");
  }
}

}  // namespace
}  // namespace dtrain

