// Checkpoints of composed parallelism: a pipeline of DDP stages over a
// 2 x 2 mesh (each rank holding its stage's parameters, replicas holding
// the same) loads into one process; HSDP's shards (two replicas of each)
// load into FSDP at 3 ranks; both bitwise, with each entry written once.

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>

#include "common/paths.h"
#include "dtrain/dtrain.h"
#include "harness/assembled_state.h"
#include "harness/assertions.h"
#include "harness/fsdp_models.h"
#include "harness/temp_dir.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::RankContext;
using testing::run_rank_contexts;
using testing::thread_mesh;
namespace ckpt = checkpoint;
namespace pp = pipelining;

constexpr int kComposedWidth = 12, kComposedRows = 8;

torch::nn::Sequential mlp(int seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential m;
  for (int i = 0; i < 4; ++i) {
    m->push_back(torch::nn::Linear(kComposedWidth, kComposedWidth));
    m->push_back(torch::nn::Functional(torch::tanh));
  }
  return m;
}

using Collected = testing::AssembledState;

int64_t data_bytes(const std::string& dir) {
  int64_t total = 0;
  for (const auto& name : paths::list(dir)) {
    struct stat st {};
    if (name.rfind("data-", 0) == 0 && ::stat(paths::join(dir, name).c_str(), &st) == 0)
      total += st.st_size;
  }
  return total;
}

TEST(ComposedCheckpoint, PipelineOfDdpStagesLoadsIntoOneProcess) {
  testing::TempDir dir;
  Collected saved, loaded;
  std::vector<torch::nn::Sequential> models;
  for (int r = 0; r < 4; ++r) models.push_back(mlp(3));
  torch::manual_seed(8);
  const auto x = torch::randn({kComposedRows, kComposedWidth}), y = torch::randn({kComposedRows, kComposedWidth});
  auto mse = [](const at::Tensor& o, const at::Tensor& t) { return torch::mse_loss(o, t); };
  testing::expect_no_errors(run_rank_contexts(4, [&](RankContext& ctx) {
    auto mesh = DeviceMesh({2, 2}, {"pp", "dp"}, thread_mesh(ctx));
    const int stage = mesh.get_local_rank("pp"), replica = mesh.get_local_rank("dp");
    auto piece = pp::split_sequential(models[ctx.rank], 2)[stage];
    auto ddp = std::make_shared<DistributedDataParallel<torch::nn::SequentialImpl>>(
        piece.ptr(), DDPOptions().process_group(mesh.get_group("dp")));
    pp::Schedule1F1B schedule(pp::PipelineStage(ddp, stage, 2, pp::PipelineStageOptions().group(mesh.get_group("pp"))),
                              2, mse);
    torch::optim::Adam opt(ddp->parameters(), torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      if (stage == 0) schedule.step(x.chunk(2)[replica]);
      else schedule.step(y.chunk(2)[replica], nullptr);
      opt.step();
    }
    ckpt::DistributedState state;  // this stage's entries only: "param/0.weight" on stage 0, ...
    ckpt::add_module(state, *piece);
    ckpt::add_optimizer(state, opt, *piece);
    ckpt::save(dir.path(), state, ckpt::SaveOptions().process_group(ctx.group));
    saved.add(state);
  }, 60s));
  // One process, the whole model (other values: all must come from the checkpoint).
  auto whole = mlp(11);
  torch::optim::Adam opt(whole->parameters(), torch::optim::AdamOptions(1e-2));
  ckpt::DistributedState state;
  ckpt::add_module(state, *whole);
  ckpt::add_optimizer(state, opt, *whole);
  ckpt::load(dir.path(), state);
  loaded.add(state);
  EXPECT_EQ(saved.size(), 8u * 4u);  // 8 tensors x (value, exp_avg, exp_avg_sq, step)
  saved.expect_equal(loaded);
  // Each entry written once, not once per replica.
  EXPECT_LT(data_bytes(dir.path()), saved.bytes() * 3 / 2) << "replicas' copies were written";
}

TEST(ComposedCheckpoint, HsdpShardsLoadIntoFsdpAtThreeRanks) {
  testing::TempDir dir;
  Collected saved, loaded;
  std::vector<std::shared_ptr<testing::BlockStackImpl>> trained, fresh;
  for (int r = 0; r < 4; ++r) {
    torch::manual_seed(0);
    trained.push_back(std::make_shared<testing::BlockStackImpl>());
  }
  for (int r = 0; r < 3; ++r) {
    torch::manual_seed(5);
    fresh.push_back(std::make_shared<testing::BlockStackImpl>());
  }
  torch::manual_seed(9);
  const auto x = torch::randn({4, 4, 3, 10});
  auto adam = [](const std::vector<at::Tensor>& p) {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-3));
  };
  testing::expect_no_errors(run_rank_contexts(4, [&](RankContext& ctx) {
    auto mesh = DeviceMesh({2, 2}, {"replicate", "shard"}, thread_mesh(ctx));
    FullyShardedDataParallel hsdp(trained[ctx.rank], FSDPOptions().mesh(mesh));
    auto opt = adam(hsdp.parameters());
    for (int step = 0; step < 2; ++step) {
      opt->zero_grad();
      hsdp.forward(x[ctx.rank]).pow(2).mean().backward();
      opt->step();
    }
    ckpt::DistributedState state;
    ckpt::add_fsdp(state, hsdp, *opt);
    ckpt::save(dir.path(), state, ckpt::SaveOptions().process_group(ctx.group));
    saved.add(state);
  }, 60s));
  EXPECT_LT(data_bytes(dir.path()), saved.bytes() * 3 / 2) << "both replicas' shards were written";
  testing::expect_no_errors(run_rank_contexts(3, [&](RankContext& ctx) {
    FullyShardedDataParallel fsdp(fresh[ctx.rank], FSDPOptions().process_group(ctx.group));
    auto opt = adam(fsdp.parameters());
    ckpt::DistributedState state;
    ckpt::add_fsdp(state, fsdp, *opt);
    ckpt::load(dir.path(), state);
    loaded.add(state);
  }, 60s));
  EXPECT_GT(saved.size(), 20u);
  saved.expect_equal(loaded);
}

}  // namespace
}  // namespace dtrain
