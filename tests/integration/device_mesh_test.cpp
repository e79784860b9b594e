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

// Groups of a thread rank's mesh: tcp groups on the test's store, named by
// their ranks.
DeviceMeshOptions thread_mesh(RankContext& ctx) {
  return DeviceMeshOptions().group(ctx.group).new_group([&ctx](const std::vector<int>& ranks) {
    std::string name = "mesh";
    for (int r : ranks) name += "-" + std::to_string(r);
    const auto at = std::find(ranks.begin(), ranks.end(), ctx.rank);
    const int me = static_cast<int>(at - ranks.begin());
    return create_process_group("tcp", std::make_shared<PrefixStore>(name, ctx.store), me,
                                static_cast<int>(ranks.size()),
                                GroupOptions().name(name).global_ranks(ranks));
  });
}

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
    auto swapped = mesh[std::vector<std::string>{"dp", "pp"}];
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
// each DDP synchronized once per step. With 1F1B (a stage per rank) and
// with ZB-V (two per rank, each backward in two halves).
constexpr int kWidth = 10, kRows = 16, kSteps = 5;

void expect_pipeline_times_ddp_equals_one_process(bool zbv) {
  SCOPED_TRACE(zbv ? "ZBV" : "1F1B");
  auto make_model = [] {
    torch::manual_seed(3);
    torch::nn::Sequential m;
    for (int i = 0; i < 4; ++i) {
      m->push_back(torch::nn::Linear(kWidth, kWidth));
      m->push_back(torch::nn::Functional(torch::tanh));
    }
    return m;
  };
  torch::manual_seed(5);
  std::vector<std::pair<at::Tensor, at::Tensor>> data;
  for (int s = 0; s < kSteps; ++s)
    data.emplace_back(torch::randn({kRows, kWidth}), torch::randn({kRows, kWidth}));
  auto mse = [](const at::Tensor& o, const at::Tensor& t) { return torch::mse_loss(o, t); };
  auto whole = make_model();
  torch::optim::Adam ref_opt(whole->parameters(), torch::optim::AdamOptions(1e-2));
  for (const auto& [x, y] : data) {
    ref_opt.zero_grad();
    mse(whole->forward(x), y).backward();
    ref_opt.step();
  }
  std::vector<torch::nn::Sequential> models;
  for (int r = 0; r < 4; ++r) models.push_back(make_model());
  expect_no_errors(run_rank_contexts(4, [&](RankContext& ctx) {
    auto mesh = DeviceMesh({2, 2}, {"pp", "dp"}, thread_mesh(ctx));
    const int pp_rank = mesh.get_local_rank("pp"), replica = mesh.get_local_rank("dp");
    const int num_stages = zbv ? 4 : 2;
    const std::vector<int> held = zbv ? std::vector<int>{pp_rank, 3 - pp_rank}
                                      : std::vector<int>{pp_rank};
    auto pieces = pp::split_sequential(models[ctx.rank], num_stages);
    std::vector<pp::PipelineStage> stages;
    std::vector<std::shared_ptr<DistributedDataParallel<torch::nn::SequentialImpl>>> ddps;
    std::vector<torch::Tensor> params;
    for (int s : held) {
      ddps.push_back(std::make_shared<DistributedDataParallel<torch::nn::SequentialImpl>>(
          pieces[s].ptr(), DDPOptions().process_group(mesh.get_group("dp"))));
      for (const auto& p : ddps.back()->parameters()) params.push_back(p);
      stages.emplace_back(ddps.back(), s, num_stages,
                          pp::PipelineStageOptions().group(mesh.get_group("pp")));
    }
    std::unique_ptr<pp::PipelineSchedule> schedule;
    if (zbv) schedule = std::make_unique<pp::ScheduleZBVZeroBubble>(stages, 4, mse);
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
      EXPECT_EQ(ddp->stats().iteration, kSteps) << "DDP synchronizes once per step";
    const int per = 8 / num_stages;
    for (int s : held)
      for (int c = s * per; c < (s + 1) * per; ++c) {
        auto got = models[ctx.rank]->children()[c]->parameters();
        auto want = whole->children()[c]->parameters();
        for (size_t i = 0; i < got.size(); ++i)
          EXPECT_LE((got[i] - want[i]).abs().max().item<double>(),
                    1e-5 * want[i].abs().max().item<double>())
              << "child " << c << " on rank " << ctx.rank;
      }
  }));
}

TEST(DeviceMesh, PipelineTimesDataParallelEqualsOneProcess) {
  expect_pipeline_times_ddp_equals_one_process(false);
  expect_pipeline_times_ddp_equals_one_process(true);
}

}  // namespace
}  // namespace dtrain
