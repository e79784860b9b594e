// DeviceMesh: the groups along each dimension, slices and flattening; and
// a pipeline composed with data parallelism over a 2 x 2 mesh, equal to one
// process.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>

#include "harness/assertions.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

namespace pp = pipelining;
using namespace std::chrono_literals;
using testing::expect_no_errors;
using testing::RankContext;
using testing::run_rank_contexts;
using testing::thread_mesh;

// 2 x 3 over 6 ranks: rank r sits at (r / 3, r % 3).
TEST(DeviceMesh, GroupsAlongEachDimensionSlicesAndFlattening) {
  expect_no_errors(run_rank_contexts(6, [&](RankContext& ctx) {
    const int r = ctx.rank;
    DeviceMesh mesh({2, 3}, {"pp", "dp"}, thread_mesh(ctx));
    EXPECT_EQ(mesh.ndim(), 2);
    EXPECT_EQ(mesh.shape(), (std::vector<int>{2, 3}));
    EXPECT_EQ(mesh.size(), 6);
    EXPECT_EQ(mesh.size("dp"), 3);
    EXPECT_EQ(mesh.get_local_rank("pp"), r / 3);
    EXPECT_EQ(mesh.get_local_rank(1), r % 3);
    EXPECT_EQ(mesh.get_coordinate(), (std::vector<int>{r / 3, r % 3}));
    const int row = r / 3 * 3, col = r % 3;
    EXPECT_EQ(mesh.get_group("dp")->global_ranks(), (std::vector<int>{row, row + 1, row + 2}));
    EXPECT_EQ(mesh.get_group("pp")->global_ranks(), (std::vector<int>{col, col + 3}));
    // The groups work: a sum along "dp" adds the row's ranks.
    auto t = at::full({1}, static_cast<double>(r));
    mesh.get_group("dp")->all_reduce(t)->wait();
    EXPECT_EQ(t.item<double>(), 3.0 * row + 3);

    auto dp = mesh["dp"];
    EXPECT_EQ(dp.ndim(), 1);
    EXPECT_EQ(dp.get_group(), mesh.get_group("dp"));  // shared, not rebuilt
    EXPECT_EQ(dp.ranks(), (std::vector<int>{row, row + 1, row + 2}));
    auto swapped = mesh[{"dp", "pp"}];  // braces: the initializer_list overload
    EXPECT_EQ(swapped.mesh_dim_names(), (std::vector<std::string>{"dp", "pp"}));
    EXPECT_EQ(swapped.ranks(), (std::vector<int>{0, 3, 1, 4, 2, 5}));

    auto flat = mesh.flatten();
    EXPECT_EQ(flat.mesh_dim_names(), (std::vector<std::string>{"pp_dp"}));
    EXPECT_EQ(flat.size(), 6);
    EXPECT_EQ(flat.get_local_rank("pp_dp"), r);
    EXPECT_EQ(mesh["pp_dp"].get_group(), flat.get_group());
    auto all = at::ones({1});
    flat.get_group()->all_reduce(all)->wait();
    EXPECT_EQ(all.item<double>(), 6.0);

    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { mesh["tp"]; }),
              "DeviceMesh: no dimension 'tp' in the mesh of [pp, dp]");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { mesh.get_group(); }),
              "DeviceMesh: get_group() without a dimension is for a 1-D mesh; this one has 2 "
              "dimensions [pp, dp]");
  }));
}

TEST(DeviceMesh, ShapesThatDoNotFitTheGroupAreNamed) {
  expect_no_errors(run_rank_contexts(2, [&](RankContext& ctx) {
    EXPECT_EQ(testing::what_thrown<InvalidArgument>(
                  [&] { DeviceMesh({2, 2}, {"pp", "dp"}, thread_mesh(ctx)); }),
              "DeviceMesh: mesh_shape [2, 2] holds 4 ranks but group 'default' has 2");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>(
                  [&] { DeviceMesh({1, 2}, {"dp", "dp"}, thread_mesh(ctx)); }),
              "DeviceMesh: mesh_dim_names [dp, dp] repeat a name");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>(
                  [&] { DeviceMesh({2}, {"dp"}, DeviceMeshOptions().group(ctx.group)); }),
              "DeviceMesh: a mesh over group 'default' (not the default group) needs "
              "DeviceMeshOptions::new_group; new_group is called by every rank of the default "
              "group");
  }));
}

// PP(2) x DP(2): each pipeline rank's stages are wrapped in DDP over the
// mesh's "dp" group, each data-parallel replica takes half the batch; after
// 5 steps of Adam every stage equals one process on the whole batch, and
// each data-parallel wrapper synchronized once per step: DDP stages under
// 1F1B (a stage per rank) and ZB-V (two per rank, each backward in two
// halves); FSDP stages (their Linears units of their own) under GPipe and
// 1F1B.
constexpr int kMeshWidth = 10, kMeshRows = 16, kMeshSteps = 5;

enum class Composition { DDP_1F1B, DDP_ZBV, FSDP_GPIPE, FSDP_1F1B };

using ShardedLinear = FullyShard<torch::nn::LinearImpl>;

torch::nn::Sequential mesh_model(bool sharded_units) {
  torch::manual_seed(3);
  torch::nn::Sequential m;
  for (int i = 0; i < 4; ++i) {
    if (sharded_units)
      m->push_back(std::make_shared<ShardedLinear>(kMeshWidth, kMeshWidth));
    else
      m->push_back(torch::nn::Linear(kMeshWidth, kMeshWidth));
    m->push_back(torch::nn::Functional(torch::tanh));
  }
  return m;
}

void expect_pipeline_times_dp_equals_one_process(Composition how) {
  const bool zbv = how == Composition::DDP_ZBV;
  const bool fsdp = how == Composition::FSDP_GPIPE || how == Composition::FSDP_1F1B;
  SCOPED_TRACE(static_cast<int>(how));
  torch::manual_seed(5);
  std::vector<std::pair<at::Tensor, at::Tensor>> data;
  for (int s = 0; s < kMeshSteps; ++s)
    data.emplace_back(torch::randn({kMeshRows, kMeshWidth}), torch::randn({kMeshRows, kMeshWidth}));
  auto mse = [](const at::Tensor& o, const at::Tensor& t) { return torch::mse_loss(o, t); };
  auto whole = mesh_model(false);
  torch::optim::Adam ref_opt(whole->parameters(), torch::optim::AdamOptions(1e-2));
  for (const auto& [x, y] : data) {
    ref_opt.zero_grad();
    mse(whole->forward(x), y).backward();
    ref_opt.step();
  }
  std::vector<torch::nn::Sequential> models;
  for (int r = 0; r < 4; ++r) models.push_back(mesh_model(fsdp));
  expect_no_errors(run_rank_contexts(4, [&](RankContext& ctx) {
    auto mesh = DeviceMesh({2, 2}, {"pp", "dp"}, thread_mesh(ctx));
    const int pp_rank = mesh.get_local_rank("pp"), replica = mesh.get_local_rank("dp");
    const int num_stages = zbv ? 4 : 2;
    const std::vector<int> held = zbv ? std::vector<int>{pp_rank, 3 - pp_rank}
                                      : std::vector<int>{pp_rank};
    auto pieces = pp::split_sequential(models[ctx.rank], num_stages);
    std::vector<pp::PipelineStage> stages;
    std::vector<std::shared_ptr<DistributedDataParallel<torch::nn::SequentialImpl>>> ddps;
    std::vector<std::shared_ptr<FullyShardedDataParallel<torch::nn::SequentialImpl>>> fsdps;
    std::vector<torch::Tensor> params;
    const auto on_pp = pp::PipelineStageOptions().group(mesh.get_group("pp"));
    for (int s : held) {
      if (fsdp) {
        fsdps.push_back(std::make_shared<FullyShardedDataParallel<torch::nn::SequentialImpl>>(
            pieces[s].ptr(), FSDPOptions().mesh(mesh["dp"])));
        for (const auto& p : fsdps.back()->parameters()) params.push_back(p);
        stages.emplace_back(fsdps.back(), s, num_stages, on_pp);
        continue;
      }
      ddps.push_back(std::make_shared<DistributedDataParallel<torch::nn::SequentialImpl>>(
          pieces[s].ptr(), DDPOptions().process_group(mesh.get_group("dp"))));
      for (const auto& p : ddps.back()->parameters()) params.push_back(p);
      stages.emplace_back(ddps.back(), s, num_stages, on_pp);
    }
    std::unique_ptr<pp::PipelineSchedule> schedule;
    if (zbv) schedule = std::make_unique<pp::ScheduleZBVZeroBubble>(stages, 4, mse);
    else if (how == Composition::FSDP_GPIPE) schedule = std::make_unique<pp::ScheduleGPipe>(stages[0], 4, mse);
    else schedule = std::make_unique<pp::Schedule1F1B>(stages[0], 4, mse);
    torch::optim::Adam opt(params, torch::optim::AdamOptions(1e-2));
    for (const auto& [x, y] : data) {
      opt.zero_grad();
      const auto half = [&](const at::Tensor& t) { return t.chunk(2)[replica]; };
      if (zbv && pp_rank == 0) schedule->step(half(x), half(y), nullptr);  // stages 0 and 3
      else if (zbv) schedule->step();                                      // stages 1 and 2
      else if (pp_rank == 0) schedule->step(half(x));
      else schedule->step(half(y), nullptr);
      opt.step();
    }
    for (const auto& ddp : ddps)
      EXPECT_EQ(ddp->stats().iteration, kMeshSteps) << "DDP synchronizes once per step";
    for (const auto& f : fsdps) {
      EXPECT_EQ(f->stats().iteration, kMeshSteps) << "FSDP reduces once per step";
      EXPECT_EQ(f->stats().reduce_scatters, 2) << "one per unit (the stage's two Linears), in the last backward";
    }
    // The pieces keep the model's child names: "2.weight" is child 2's.
    std::map<std::string, at::Tensor> got;
    for (const auto& f : fsdps)
      for (const auto& [name, t] : f->full_state_dict()) got[name] = t;
    for (const auto& piece : pieces)
      if (!fsdp)
        for (const auto& item : piece->named_parameters()) got[item.key()] = item.value();
    const int per = 8 / num_stages;
    size_t compared = 0;
    for (int s : held)
      for (int c = s * per; c < (s + 1) * per; ++c)
        for (const auto& item : whole->children()[c]->named_parameters()) {
          const std::string name = std::to_string(c) + "." + item.key();
          ASSERT_TRUE(got.count(name)) << name << " on rank " << ctx.rank;
          const auto& want = item.value();
          EXPECT_LE((got[name] - want).abs().max().item<double>(), 1e-5 * want.abs().max().item<double>())
              << name << " on rank " << ctx.rank;
          ++compared;
        }
    EXPECT_EQ(compared, per * held.size()) << "two parameters per Linear, one Linear per two children";
  }));
}

TEST(DeviceMesh, PipelineTimesDataParallelEqualsOneProcess) {
  expect_pipeline_times_dp_equals_one_process(Composition::DDP_1F1B);
  expect_pipeline_times_dp_equals_one_process(Composition::DDP_ZBV);
}

TEST(DeviceMesh, PipelineOfFsdpStagesEqualsOneProcess) {
  expect_pipeline_times_dp_equals_one_process(Composition::FSDP_GPIPE);
  expect_pipeline_times_dp_equals_one_process(Composition::FSDP_1F1B);
}

TEST(DeviceMesh, ZeroBubbleRefusesFsdpStagesNamingThem) {
  expect_no_errors(run_rank_contexts(2, [&](RankContext& ctx) {
    torch::manual_seed(0);
    auto pieces = pp::split_sequential(mesh_model(true), 4);
    auto mse = [](const at::Tensor& o, const at::Tensor& t) { return torch::mse_loss(o, t); };
    auto solo = std::make_shared<PrefixStore>("solo" + std::to_string(ctx.rank), ctx.store);
    auto alone = create_process_group("tcp", solo, 0, 1, GroupOptions().name("alone"));
    const int r = ctx.rank;
    std::vector<pp::PipelineStage> stages;
    for (int s : {r, 3 - r})
      stages.emplace_back(std::make_shared<FullyShardedDataParallel<torch::nn::SequentialImpl>>(
                              pieces[s].ptr(), FSDPOptions().process_group(alone)),
                          s, 4, pp::PipelineStageOptions().group(ctx.group));
    EXPECT_EQ(testing::what_thrown<InvalidArgument>(
                  [&] { pp::ScheduleZBVZeroBubble schedule(stages, 4, mse); }),
              "ScheduleZBVZeroBubble: stage " + std::to_string(std::min(r, 3 - r)) +
                  " is a FullyShardedDataParallel, whose backward cannot be split into the "
                  "input's and the weights' halves; use DDP or a plain module for its stages, or "
                  "another schedule");
  }));
}

}  // namespace
}  // namespace dtrain
