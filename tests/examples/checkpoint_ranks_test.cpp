// The training example's checkpoints across ranks (threads over an in-memory
// store, per backend and world size): a save or a load that fails on any one
// rank stops every rank at once (well under the group's timeout) with the
// same error, no rank applies a checkpoint unless every rank validated it,
// and a checkpoint of N ranks loads at any number of ranks.

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <cerrno>
#include <memory>
#include <tuple>
#include <vector>

#include "checkpoint_test_util.h"
#include "fashion_mnist/checkpoint.h"
#include "fashion_mnist/model.h"
#include "harness/assertions.h"
#include "harness/thread_ranks.h"

namespace {

using namespace checkpoint_test;
using dtrain::ProcessGroup;
using dtrain::testing::Contains;
using dtrain::testing::seconds_since;

constexpr auto kGroupTimeout = std::chrono::seconds(60);
constexpr double kPrompt = 15;  // seconds: "at once", far below kGroupTimeout

class CheckpointRanks : public ::testing::TestWithParam<std::tuple<std::string, int>> {
 protected:
  const std::string& backend() const { return std::get<0>(GetParam()); }
  int world() const { return std::get<1>(GetParam()); }
  std::vector<std::string> run(
      const std::function<void(const std::shared_ptr<ProcessGroup>&)>& body) {
    return dtrain::testing::run_rank_contexts(
        world(), [&](dtrain::testing::RankContext& ctx) { body(ctx.group); }, kGroupTimeout,
        dtrain::GroupOptions(), backend());
  }
  std::string path(const std::string& name) const {
    return temp_path(backend() + std::to_string(world()) + "-" + name);
  }
};

// The last rank cannot write its data file; the others could.
TEST_P(CheckpointRanks, SaveFailureOnOneRankStopsEveryRankAtOnce) {
  const auto dir = path("nosave");
  const int last = world() - 1;
  const auto start = std::chrono::steady_clock::now();
  auto errors = run([&](const std::shared_ptr<ProcessGroup>& g) {
    ConvNet model;
    torch::optim::Adam opt(model->parameters());
    CheckpointFaults faults;
    if (g->rank() == last) faults.fsync_errno = ENOSPC;
    save_checkpoint(g, dir, *model, opt, {1, 0, 19, g->size()}, faults);
  });
  EXPECT_LT(seconds_since(start), kPrompt);
  for (int r = 0; r < world(); ++r) {
    EXPECT_TRUE(Contains(errors[r], "cannot save checkpoint " + dir + ": rank " + std::to_string(last) +
                                        ": cannot save tensor file " + dir + "/data-"))
        << "rank " << r << ": " << errors[r];
    EXPECT_TRUE(Contains(errors[r], "No space left on device")) << "rank " << r;
  }
  EXPECT_NE(::access((dir + "/metadata.dtt").c_str(), F_OK), 0) << "a failed save was committed";
  remove_dir(dir);
}

// Every rank but the last reads a valid checkpoint, the last a copy with a
// truncated data file: nobody installs anything.
TEST_P(CheckpointRanks, LoadFailureOnOneRankStopsEveryRankUntouched) {
  const auto good = path("good"), cut = path("cut");
  {
    ConvNet source;
    torch::optim::Adam opt(source->parameters());
    step(*source, opt);
    save_alone(good, *source, opt, {1, 96, 22, world()});
    save_alone(cut, *source, opt, {1, 96, 22, world()});
    ASSERT_EQ(::truncate(data_file(cut).c_str(), 1000), 0);
  }
  const int last = world() - 1;
  const auto start = std::chrono::steady_clock::now();
  auto errors = run([&](const std::shared_ptr<ProcessGroup>& g) {
    ConvNet model;
    torch::optim::Adam opt(model->parameters());
    step(*model, opt);
    auto params = copy_of(*model);
    auto state = snapshot(opt);
    try {
      load_checkpoint(g, g->rank() == last ? cut : good, *model, opt, 1200);
    } catch (...) {
      expect_unchanged(*model, params);
      expect_unchanged(opt, state);
      throw;
    }
  });
  EXPECT_LT(seconds_since(start), kPrompt);
  for (int r = 0; r < world(); ++r)
    EXPECT_TRUE(Contains(errors[r], "rank " + std::to_string(last) + ": cannot load checkpoint " + cut +
                                        ": tensor file " + data_file(cut) + ": truncated"))
        << "rank " << r << ": " << errors[r];
  remove_dir(good);
  remove_dir(cut);
}

// Saved by this many ranks, each its share, loaded at 1 and 2 ranks: every
// rank gets the model and Adam's state bit for bit. (The ranks' models are
// built and trained on this thread: the global RNG is not for threads.)
TEST_P(CheckpointRanks, SavedByTheseRanksLoadsAtAnyWorldSize) {
  const auto dir = path("ok");
  std::vector<ConvNet> models;
  std::vector<std::unique_ptr<torch::optim::Adam>> opts;
  for (int r = 0; r < world(); ++r) {
    torch::manual_seed(5);  // the same replica on every rank
    models.emplace_back();
    opts.push_back(std::make_unique<torch::optim::Adam>(models.back()->parameters()));
    step(*models.back(), *opts.back());
  }
  const auto expected = copy_of(*models[0]);
  const auto expected_opt = snapshot(*opts[0]);
  dtrain::testing::expect_no_errors(run([&](const std::shared_ptr<ProcessGroup>& g) {
    save_checkpoint(g, dir, *models[g->rank()], *opts[g->rank()], {2, 480, 43, g->size()});
  }));
  for (int load_world : {1, 2}) {
    dtrain::testing::expect_no_errors(dtrain::testing::run_rank_contexts(
        load_world, [&](dtrain::testing::RankContext& ctx) {
          ConvNet model;
          torch::optim::Adam opt(model->parameters());
          auto state = load_checkpoint(ctx.group, dir, *model, opt, 1200);
          EXPECT_EQ(state.epoch, 2);
          EXPECT_EQ(state.samples_in_epoch, 480);
          EXPECT_EQ(state.global_step, 43);
          EXPECT_EQ(state.world_size, world());
          expect_unchanged(*model, expected);
          expect_unchanged(opt, expected_opt);
        }, kGroupTimeout, dtrain::GroupOptions(), backend()));
  }
  remove_dir(dir);
}

INSTANTIATE_TEST_SUITE_P(Backends, CheckpointRanks,
                         ::testing::Combine(::testing::Values("tcp", "shm"),
                                            ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" +
                                  std::to_string(std::get<1>(info.param)) + "ranks";
                         });

}  // namespace
