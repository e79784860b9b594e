// The training example's checkpoints across ranks (threads over an in-memory
// store, per backend and world size): a save that fails on rank 0, or a load
// that fails on any one rank, stops every rank at once (well under the
// group's timeout) with the same error, and no rank applies a checkpoint
// unless every rank validated it.

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <tuple>

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
  std::vector<std::string> run(const std::function<void(ProcessGroup&)>& body) {
    return dtrain::testing::run_ranks(world(), body, kGroupTimeout, dtrain::GroupOptions(),
                                      backend());
  }
  std::string path(const std::string& name) const {
    return temp_path(backend() + std::to_string(world()) + "-" + name);
  }
};

TEST_P(CheckpointRanks, SaveFailureOnRank0StopsEveryRankAtOnce) {
  const auto blocker = path("blocker");
  std::ofstream(blocker) << "a file, not a directory";
  const auto target = blocker + "/checkpoint.dtt";
  const auto start = std::chrono::steady_clock::now();
  auto errors = run([&](ProcessGroup& g) {
    ConvNet model;
    torch::optim::Adam opt(model->parameters());
    save_checkpoint_from_rank0(g, target, *model, opt, {1, 0, 19, g.size()});
  });
  EXPECT_LT(seconds_since(start), kPrompt);
  for (int r = 0; r < world(); ++r)
    EXPECT_EQ(errors[r], "rank 0: cannot save checkpoint " + target + ": cannot create " + target +
                             ".tmp: Not a directory")
        << "rank " << r;
  unlink(blocker.c_str());
}

// Every rank but the last gets a valid file, the last a truncated one.
TEST_P(CheckpointRanks, LoadFailureOnOneRankStopsEveryRankUntouched) {
  const auto good = path("good.dtt"), cut = path("cut.dtt");
  {
    ConvNet source;
    torch::optim::Adam opt(source->parameters());
    step(*source, opt);
    save_checkpoint(good, *source, opt, {1, 3, 22, world()});
    std::ifstream in(good, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    std::ofstream(cut, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  }
  const int last = world() - 1;
  const auto start = std::chrono::steady_clock::now();
  auto errors = run([&](ProcessGroup& g) {
    ConvNet model;
    torch::optim::Adam opt(model->parameters());
    step(*model, opt);
    auto params = copy_of(*model);
    auto state = snapshot(opt);
    try {
      load_checkpoint_on_all_ranks(g, g.rank() == last ? cut : good, *model, opt);
    } catch (...) {
      expect_unchanged(*model, params);
      expect_unchanged(opt, state);
      throw;
    }
  });
  EXPECT_LT(seconds_since(start), kPrompt);
  for (int r = 0; r < world(); ++r)
    EXPECT_TRUE(Contains(errors[r], "rank " + std::to_string(last) + ": checkpoint " + cut +
                                        " is truncated or corrupt"))
        << "rank " << r;
  unlink(good.c_str());
  unlink(cut.c_str());
}

TEST_P(CheckpointRanks, SavedByRank0LoadedByEveryRank) {
  const auto file = path("ok.dtt");
  ConvNet source;
  torch::optim::Adam source_opt(source->parameters());
  step(*source, source_opt);
  auto expected = copy_of(*source);
  auto errors = run([&](ProcessGroup& g) {
    ConvNet mine;
    torch::optim::Adam opt(mine->parameters());
    // Only rank 0's model is written; the others' differ and are replaced.
    auto& model = g.rank() == 0 ? source : mine;
    auto& optimizer = g.rank() == 0 ? source_opt : opt;
    save_checkpoint_from_rank0(g, file, *model, optimizer, {2, 5, 43, g.size()});
    auto state = load_checkpoint_on_all_ranks(g, file, *mine, opt);
    EXPECT_EQ(state.epoch, 2);
    EXPECT_EQ(state.step_in_epoch, 5);
    EXPECT_EQ(state.global_step, 43);
    expect_unchanged(*mine, expected);
  });
  dtrain::testing::expect_no_errors(errors);
  unlink(file.c_str());
}

INSTANTIATE_TEST_SUITE_P(Backends, CheckpointRanks,
                         ::testing::Combine(::testing::Values("tcp", "shm"),
                                            ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" +
                                  std::to_string(std::get<1>(info.param)) + "ranks";
                         });

}  // namespace
