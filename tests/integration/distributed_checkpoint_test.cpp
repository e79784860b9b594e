// Distributed checkpoints: FSDP and ZeroRedundancyOptimizer states saved by
// 2 ranks load on 1 and on 3 ranks with parameters and Adam state bitwise
// equal to what was saved; each rank writes about 1/N of the bytes; a resume
// at the same world size continues bitwise like an uninterrupted run; bad
// checkpoints and mismatched states are named. (A rank killed while saving:
// process_test's CheckpointCrash.)

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>

#include <cerrno>
#include <fstream>
#include <mutex>

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
namespace ckpt = checkpoint;

using testing::seeded_stacks;
auto stacks(int world, int seed) { return seeded_stacks(world, seed); }

// Inputs for steps 0..7 of ranks 0..3, drawn once on the main thread
// (the generator is shared: rank threads seeding it would race).
torch::Tensor batch(int step, int rank) {
  static const std::vector<torch::Tensor> inputs = [] {
    torch::manual_seed(1000);
    std::vector<torch::Tensor> out;
    for (int i = 0; i < 8 * 4; ++i) out.push_back(torch::randn({4, 3, 10}));
    return out;
  }();
  return inputs.at(step * 4 + rank);
}

template <typename M>
void train_steps(FullyShardedDataParallel<M>& fsdp, torch::optim::Optimizer& opt, int rank, int from,
                 int to) {
  for (int s = from; s < to; ++s) {
    opt.zero_grad();
    fsdp.forward(batch(s, rank)).pow(2).mean().backward();
    opt.step();
  }
}

using Assembled = testing::AssembledState;

std::unique_ptr<torch::optim::Adam> adam(const std::vector<torch::Tensor>& params) {
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3));
}

// Saves after 3 steps at 2 ranks, loads into fresh models at `load_world`.
void expect_fsdp_reshards_to(int load_world) {
  testing::TempDir dir;
  Assembled saved, loaded;
  auto trained = stacks(2, 0);
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    FullyShardedDataParallel fsdp(trained[ctx.rank], FSDPOptions().process_group(ctx.group));
    auto opt = adam(fsdp.parameters());
    train_steps(fsdp, *opt, ctx.rank, 0, 3);
    ckpt::DistributedState state;
    ckpt::add_fsdp(state, fsdp, *opt);
    state.metadata["step"] = "3";
    ckpt::save(dir.path(), state, ckpt::SaveOptions().process_group(ctx.group));
    saved.add(state);
  }, 60s);
  testing::expect_no_errors(errors);
  auto fresh = stacks(load_world, 5);  // other values: all must come from the checkpoint
  errors = run_rank_contexts(load_world, [&](RankContext& ctx) {
    FullyShardedDataParallel fsdp(fresh[ctx.rank], FSDPOptions().process_group(ctx.group));
    auto opt = adam(fsdp.parameters());
    ckpt::DistributedState state;
    ckpt::add_fsdp(state, fsdp, *opt);
    ckpt::load(dir.path(), state);
    EXPECT_EQ(state.metadata.at("step"), "3");
    loaded.add(state);
    // The optimizer really holds the loaded state: one more step runs from it.
    train_steps(fsdp, *opt, ctx.rank, 3, 4);
  }, 60s);
  testing::expect_no_errors(errors);
  EXPECT_GT(saved.size(), 20u);  // 7 units x (param, exp_avg, exp_avg_sq, step)
  saved.expect_equal(loaded);
  EXPECT_EQ(ckpt::inspect(dir.path()).world_size, 2);
}

class DistributedCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override { batch(0, 0); }  // draws the inputs before any rank thread
};

TEST_F(DistributedCheckpoint, FsdpSavedByTwoRanksLoadsOnOneBitwise) { expect_fsdp_reshards_to(1); }
TEST_F(DistributedCheckpoint, FsdpSavedByTwoRanksLoadsOnThreeBitwise) { expect_fsdp_reshards_to(3); }

int64_t file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

TEST_F(DistributedCheckpoint, EachRankWritesAboutItsShareAndOldFilesGo) {
  testing::TempDir dir;
  auto nets = stacks(2, 0);
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    FullyShardedDataParallel fsdp(nets[ctx.rank], FSDPOptions().process_group(ctx.group));
    auto opt = adam(fsdp.parameters());
    for (int round = 0; round < 2; ++round) {
      train_steps(fsdp, *opt, ctx.rank, round, round + 1);
      ckpt::DistributedState state;
      ckpt::add_fsdp(state, fsdp, *opt);
      ckpt::save(dir.path(), state, ckpt::SaveOptions().process_group(ctx.group));
    }
  }, 60s);
  testing::expect_no_errors(errors);
  std::vector<int64_t> sizes;
  for (const auto& name : paths::list(dir.path()))
    if (name.rfind("data-", 0) == 0) sizes.push_back(file_size(dir / name));
  ASSERT_EQ(sizes.size(), 2u) << "the first save's files are removed after the second commits";
  const double total = static_cast<double>(sizes[0] + sizes[1]);
  for (auto s : sizes) EXPECT_NEAR(s / total, 0.5, 0.05) << s << " of " << total;
}

// Same world size: 3 steps, save, a fresh process state, load, 3 more
// steps: bitwise the parameters of 6 uninterrupted steps.
TEST_F(DistributedCheckpoint, ResumeAtTheSameWorldSizeIsBitwiseUninterrupted) {
  testing::TempDir dir;
  auto straight = stacks(2, 0), first = stacks(2, 0), second = stacks(2, 9);
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    const int r = ctx.rank;
    auto group2 = create_process_group("tcp", std::make_shared<PrefixStore>("b", ctx.store), r, 2,
                                       GroupOptions().name("b").timeout(30s));
    FullyShardedDataParallel a(straight[r], FSDPOptions().process_group(ctx.group));
    auto opt_a = adam(a.parameters());
    train_steps(a, *opt_a, r, 0, 6);
    {
      FullyShardedDataParallel b(first[r], FSDPOptions().process_group(group2));
      auto opt_b = adam(b.parameters());
      train_steps(b, *opt_b, r, 0, 3);
      ckpt::DistributedState state;
      ckpt::add_fsdp(state, b, *opt_b);
      ckpt::save(dir.path(), state, ckpt::SaveOptions().process_group(group2));
    }
    FullyShardedDataParallel c(second[r], FSDPOptions().process_group(group2));
    auto opt_c = adam(c.parameters());
    ckpt::DistributedState state;
    ckpt::add_fsdp(state, c, *opt_c);
    ckpt::load(dir.path(), state);
    train_steps(c, *opt_c, r, 3, 6);
    const auto want = a.full_state_dict(), got = c.full_state_dict();
    for (const auto& [name, value] : want) EXPECT_TRUE(torch::equal(got.at(name), value)) << name;
  }, 60s);
  testing::expect_no_errors(errors);
}

// A state built once, before training (as a loop that saves every N steps
// builds it): each save records the optimizer's step counts of that save,
// so the resume is bitwise. Before, the counts of when the state was built
// (0) were saved, and Adam's bias correction restarted: FSDP's and ZeRO's.
TEST_F(DistributedCheckpoint, AStateBuiltBeforeTrainingSavesTheStepCountsOfEachSave) {
  testing::TempDir fsdp_dir, zero_dir;
  auto straight = stacks(2, 0), first = stacks(2, 0), second = stacks(2, 9);
  auto zero_straight = stacks(2, 0), zero_first = stacks(2, 0), zero_second = stacks(2, 9);
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    const int r = ctx.rank;
    FullyShardedDataParallel a(straight[r], FSDPOptions().process_group(ctx.group));
    auto opt_a = adam(a.parameters());
    train_steps(a, *opt_a, r, 0, 6);
    {
      FullyShardedDataParallel b(first[r], FSDPOptions().process_group(ctx.group));
      auto opt_b = adam(b.parameters());
      ckpt::DistributedState state;
      ckpt::add_fsdp(state, b, *opt_b);
      train_steps(b, *opt_b, r, 0, 3);
      ckpt::save(fsdp_dir.path(), state, ckpt::SaveOptions().process_group(ctx.group));
    }
    FullyShardedDataParallel c(second[r], FSDPOptions().process_group(ctx.group));
    auto opt_c = adam(c.parameters());
    ckpt::DistributedState state;
    ckpt::add_fsdp(state, c, *opt_c);
    ckpt::load(fsdp_dir.path(), state);
    train_steps(c, *opt_c, r, 3, 6);
    const auto want = a.full_state_dict(), got = c.full_state_dict();
    for (const auto& [name, value] : want) EXPECT_TRUE(torch::equal(got.at(name), value)) << "fsdp " << name;

    // ZeRO: its one step count.
    auto zero_train = [&](testing::BlockStackImpl& m, ZeroRedundancyOptimizer& opt, int from, int to) {
      for (int s = from; s < to; ++s) {
        opt.zero_grad();
        m.forward(batch(s, r)).pow(2).mean().backward();
        for (auto& p : m.parameters()) all_reduce(p.grad(), AllReduceOptions().group(ctx.group));
        opt.step();
      }
    };
    auto make_opt = [](std::vector<torch::Tensor> shard) { return adam(shard); };
    ZeroRedundancyOptions zo = ZeroRedundancyOptions().process_group(ctx.group);
    ZeroRedundancyOptimizer za(zero_straight[r]->parameters(), make_opt, zo);
    zero_train(*zero_straight[r], za, 0, 6);
    {
      ZeroRedundancyOptimizer zb(zero_first[r]->parameters(), make_opt, zo);
      ckpt::DistributedState zstate;
      ckpt::add_module(zstate, *zero_first[r]);
      ckpt::add_zero(zstate, zb);
      zero_train(*zero_first[r], zb, 0, 3);
      ckpt::save(zero_dir.path(), zstate, ckpt::SaveOptions().process_group(ctx.group));
    }
    ZeroRedundancyOptimizer zc(zero_second[r]->parameters(), make_opt, zo);
    ckpt::DistributedState zstate;
    ckpt::add_module(zstate, *zero_second[r]);
    ckpt::add_zero(zstate, zc);
    ckpt::load(zero_dir.path(), zstate);
    zero_train(*zero_second[r], zc, 3, 6);
    auto pa = zero_straight[r]->named_parameters(), pc = zero_second[r]->named_parameters();
    for (const auto& item : pa) EXPECT_TRUE(torch::equal(pc[item.key()], item.value())) << "zero " << item.key();
  }, 60s);
  testing::expect_no_errors(errors);
}

// ZeRO-1 with DDP: parameters replicated (spread over the files), Adam's
// state sharded over the flat parameter space; 2 ranks to 3.
TEST_F(DistributedCheckpoint, ZeroAndDdpStateReshardsFromTwoRanksToThree) {
  testing::TempDir dir;
  Assembled saved, loaded;
  auto make_opt = [](std::vector<torch::Tensor> shard) { return adam(shard); };
  auto trained = stacks(2, 0);
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    DistributedDataParallel ddp(trained[ctx.rank], DDPOptions().process_group(ctx.group));
    ZeroRedundancyOptimizer opt(ddp.parameters(), make_opt, ZeroRedundancyOptions().process_group(ctx.group));
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      ddp.forward(batch(s, ctx.rank)).pow(2).mean().backward();
      opt.step();
    }
    ckpt::DistributedState state;
    ckpt::add_module(state, *trained[ctx.rank]);
    ckpt::add_zero(state, opt);
    ckpt::save(dir.path(), state, ckpt::SaveOptions().process_group(ctx.group));
    saved.add(state);
  }, 60s);
  testing::expect_no_errors(errors);
  auto fresh = stacks(3, 5);
  errors = run_rank_contexts(3, [&](RankContext& ctx) {
    DistributedDataParallel ddp(fresh[ctx.rank], DDPOptions().process_group(ctx.group));
    ZeroRedundancyOptimizer opt(ddp.parameters(), make_opt, ZeroRedundancyOptions().process_group(ctx.group));
    ckpt::DistributedState state;
    ckpt::add_module(state, *fresh[ctx.rank]);
    ckpt::add_zero(state, opt);
    ckpt::load(dir.path(), state);
    loaded.add(state);
  }, 60s);
  testing::expect_no_errors(errors);
  saved.expect_equal(loaded);
}

// ZeRO-2 (DDP reduce-scattering small buckets, the partition following
// them) writes the same entries as ZeRO-1: saved at 2 ranks, its state
// loads into ZeRO-1 and into ZeRO-2 at 3 ranks.
TEST_F(DistributedCheckpoint, Zero2StateLoadsIntoZero1AndZero2AtThreeRanks) {
  testing::TempDir dir;
  Assembled saved;
  auto make_opt = [](std::vector<torch::Tensor> shard) { return adam(shard); };
  auto zero2 = [](const std::shared_ptr<ProcessGroup>& group) {
    return DDPOptions().process_group(group).shard_gradients(true).bucket_cap_mb(0.002);
  };
  auto trained = stacks(2, 0);
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    DistributedDataParallel ddp(trained[ctx.rank], zero2(ctx.group));
    ZeroRedundancyOptimizer opt(ddp, make_opt);
    for (int s = 0; s < 3; ++s) {
      ddp.forward(batch(s, ctx.rank)).pow(2).mean().backward();
      opt.step();
    }
    ckpt::DistributedState state;
    ckpt::add_module(state, *trained[ctx.rank]);
    ckpt::add_zero(state, opt);
    ckpt::save(dir.path(), state, ckpt::SaveOptions().process_group(ctx.group));
    saved.add(state);
  }, 60s);
  testing::expect_no_errors(errors);
  for (bool sharded_gradients : {false, true}) {
    Assembled loaded;
    auto fresh = stacks(3, 5);
    errors = run_rank_contexts(3, [&](RankContext& ctx) {
      std::unique_ptr<ZeroRedundancyOptimizer> opt;
      DistributedDataParallel ddp(fresh[ctx.rank], sharded_gradients
                                                        ? zero2(ctx.group)
                                                        : DDPOptions().process_group(ctx.group));
      opt = sharded_gradients ? std::make_unique<ZeroRedundancyOptimizer>(ddp, make_opt)
                              : std::make_unique<ZeroRedundancyOptimizer>(
                                    ddp.parameters(), make_opt,
                                    ZeroRedundancyOptions().process_group(ctx.group));
      ckpt::DistributedState state;
      ckpt::add_module(state, *fresh[ctx.rank]);
      ckpt::add_zero(state, *opt);
      ckpt::load(dir.path(), state);
      loaded.add(state);
    }, 60s);
    testing::expect_no_errors(errors);
    SCOPED_TRACE(sharded_gradients ? "into ZeRO-2" : "into ZeRO-1");
    saved.expect_equal(loaded);
  }
}

// add_fsdp_parameters saves each rank's ranges of each parameter, with
// its shape: the checkpoint loads whole into one process (add_module), and
// one process's loads into FSDP's ranges, at another FSDP size.
TEST_F(DistributedCheckpoint, FsdpParametersByNameLoadIntoOneProcessAndBackAtAnotherSize) {
  testing::TempDir by_fsdp, by_one;
  torch::manual_seed(11);
  torch::nn::Sequential reference(torch::nn::Linear(7, 5), torch::nn::Linear(5, 3));
  auto copy_of = [&] {
    torch::nn::Sequential m(torch::nn::Linear(7, 5), torch::nn::Linear(5, 3));
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < m->parameters().size(); ++i) m->parameters()[i].copy_(reference->parameters()[i]);
    return m;
  };
  auto zeroed = [] {
    torch::nn::Sequential m(torch::nn::Linear(7, 5), torch::nn::Linear(5, 3));
    torch::NoGradGuard no_grad;
    for (auto& p : m->parameters()) p.zero_();
    return m;
  };
  testing::expect_no_errors(run_rank_contexts(3, [&](RankContext& ctx) {
    auto model = copy_of();
    FullyShardedDataParallel<torch::nn::SequentialImpl> fsdp(model.ptr(), FSDPOptions().process_group(ctx.group));
    ckpt::DistributedState state;
    ckpt::add_fsdp_parameters(state, fsdp);
    ckpt::save(by_fsdp.path(), state, ckpt::SaveOptions().process_group(ctx.group));
  }, 30s));
  auto one = zeroed();
  ckpt::DistributedState whole;
  ckpt::add_module(whole, *one);
  ckpt::load(by_fsdp.path(), whole);
  for (size_t i = 0; i < one->parameters().size(); ++i)
    EXPECT_TRUE(at::equal(one->parameters()[i], reference->parameters()[i])) << "parameter " << i;
  testing::expect_no_errors(run_rank_contexts(1, [&](RankContext& ctx) {
    ckpt::save(by_one.path(), whole, ckpt::SaveOptions().process_group(ctx.group));
  }, 30s));
  std::vector<std::map<std::string, at::Tensor>> got(2);
  testing::expect_no_errors(run_rank_contexts(2, [&](RankContext& ctx) {
    auto model = zeroed();
    FullyShardedDataParallel<torch::nn::SequentialImpl> fsdp(model.ptr(), FSDPOptions().process_group(ctx.group));
    ckpt::DistributedState state;
    ckpt::add_fsdp_parameters(state, fsdp);
    ckpt::load(by_one.path(), state);
    got[ctx.rank] = fsdp.full_state_dict();
  }, 30s));
  for (int r = 0; r < 2; ++r)
    for (const auto& item : reference->named_parameters())
      EXPECT_TRUE(at::equal(got[r].at(item.key()), item.value().detach())) << "rank " << r << " " << item.key();
}

TEST_F(DistributedCheckpoint, MistakesAreNamed) {
  testing::TempDir dir;
  auto nets = stacks(2, 0);
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    auto& net = *nets[ctx.rank];
    ckpt::DistributedState state;
    ckpt::add_module(state, net);
    // Ranks may hold different entries (a pipeline's stages do), but not
    // one entry in two sizes, overlapping pieces, or pieces with a gap.
    const auto refusal = [&](const ckpt::DistributedState& bad) {
      return testing::what_thrown<InvalidArgument>(
          [&] { ckpt::save(dir.path(), bad, ckpt::SaveOptions().process_group(ctx.group)); });
    };
    auto bad = state;
    bad.replicated["extra"] = torch::zeros({3 + ctx.rank});
    EXPECT_EQ(refusal(bad), "checkpoint::save: replicated 'extra' is 3 elements of Float on rank 0 "
                            "but 4 of Float on rank 1; the ranks describe different states");
    bad = state;
    bad.sharded["piece"] = {torch::zeros({6}), 4 * ctx.rank, 10};
    EXPECT_EQ(refusal(bad), "checkpoint::save: the pieces of sharded 'piece' overlap: [0, 6) on rank "
                            "0 and [4, 10) on rank 1; ranks must hold the same piece or disjoint ones");
    bad = state;
    bad.sharded["piece"] = {torch::zeros({4}), 6 * ctx.rank, 10};
    EXPECT_EQ(refusal(bad), "checkpoint::save: no rank holds elements [4, 6) of sharded 'piece'");
    // A flat range that says its whole's shape: the same on every rank, and
    // the shape's size its element count.
    bad = state;
    bad.sharded["piece"] = {torch::zeros({6}), 6 * ctx.rank, 12, {}, {},
                            ctx.rank == 0 ? std::vector<int64_t>{4, 3} : std::vector<int64_t>{12}};
    EXPECT_EQ(refusal(bad), "checkpoint::save: sharded 'piece' is a flat range of shape [4, 3] on rank 0 but of "
                            "shape [12] on rank 1; the ranks describe different states");
    bad.sharded["piece"].flat_shape = {5, 3};
    EXPECT_EQ(refusal(bad), "checkpoint: sharded 'piece' says 12 elements, but its whole's shape [5, 3] has 15");
    // A name only rank 1 gets wrong: both ranks throw (none waits for it).
    bad = state;
    if (ctx.rank == 1) bad.replicated[""] = torch::zeros({1});
    EXPECT_EQ(refusal(bad),
              "checkpoint::save: rank 1: an entry's name is empty or holds a line break: ''");
    ckpt::save(dir.path(), state, ckpt::SaveOptions().process_group(ctx.group));
    ckpt::DistributedState other;
    other.replicated["param/nothing"] = torch::zeros({1});
    try {
      ckpt::load(dir.path(), other);
      ADD_FAILURE() << "a missing entry was loaded";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "checkpoint " + dir.path() + ": has no replicated 'param/nothing'"));
    }
    other.replicated.clear();
    other.replicated["param/head.weight"] = torch::zeros({4, 15});
    try {
      ckpt::load(dir.path(), other);
      ADD_FAILURE() << "a wrong shape was loaded";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "'param/head.weight' has shape [4, 16] in the checkpoint but [4, 15] here"));
    }
    try {
      ckpt::load(dir / "nowhere", other);
      ADD_FAILURE() << "a missing checkpoint was loaded";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "nowhere/metadata.dtt: cannot open"));
    }
  }, 30s);
  testing::expect_no_errors(errors);
}

// Files changed after the save never load as memory no piece wrote: a data
// file copied over another leaves a gap, and pieces that overlap must hold
// the same values there (save writes disjoint pieces, so an overlap can only
// come from files mixed up afterwards).
TEST_F(DistributedCheckpoint, TamperedPiecesWithAGapOrADisagreeingOverlapAreRefused) {
  testing::TempDir a, agree, differ;
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    const auto save = [&](const testing::TempDir& dir, int64_t split, const torch::Tensor& whole) {
      const int64_t begin = ctx.rank == 0 ? 0 : split, end = ctx.rank == 0 ? split : 8;
      ckpt::DistributedState state;
      state.sharded["w"] = ckpt::ShardedTensor{whole.narrow(0, begin, end - begin).clone(), begin, 8};
      ckpt::save(dir.path(), state, ckpt::SaveOptions().process_group(ctx.group));
    };
    const auto ones_then_twos = torch::cat({torch::ones({4}), torch::full({4}, 2.0f)});
    save(a, 4, ones_then_twos);                  // [0, 4) = 1 on rank 0, [4, 8) = 2 on rank 1
    save(agree, 2, ones_then_twos);              // rank 1: [2, 8) = 1, 1, 2, 2, 2, 2
    save(differ, 2, torch::full({8}, 7.0f));     // rank 1: [2, 8) = 7
  }, 30s);
  testing::expect_no_errors(errors);
  const auto data_file = [](const testing::TempDir& dir, int rank) {
    for (const auto& name : paths::list(dir.path()))
      if (name.rfind("data-", 0) == 0 && name.find("-" + std::to_string(rank) + ".dtt") != std::string::npos)
        return dir / name;
    ADD_FAILURE() << "no data file of rank " << rank << " in " << dir.path();
    return std::string();
  };
  const auto copy = [](const std::string& from, const std::string& to) {
    std::ifstream in(from, std::ios::binary);
    std::ofstream out(to, std::ios::binary | std::ios::trunc);
    out << in.rdbuf();
    ASSERT_TRUE(out.good()) << to;
  };
  const auto load = [&] {
    ckpt::DistributedState state;
    state.sharded["w"] = ckpt::ShardedTensor{torch::zeros({8}), 0, 8};
    ckpt::load(a.path(), state);
    return state.sharded["w"].local;
  };
  const std::string rank1 = data_file(a, 1);
  const std::string original = a / "rank1.kept";
  copy(rank1, original);
  ASSERT_TRUE(torch::equal(load(), torch::cat({torch::ones({4}), torch::full({4}, 2.0f)})));

  copy(data_file(a, 0), rank1);  // both files hold [0, 4): nothing holds [4, 8)
  EXPECT_EQ(testing::what_thrown<InvalidArgument>(load),
            "checkpoint " + a.path() + ": the saved pieces of 'w' do not cover elements [4, 8)");

  copy(data_file(differ, 1), rank1);  // [2, 8) = 7 overlaps rank 0's [0, 4) = 1
  EXPECT_EQ(testing::what_thrown<InvalidArgument>(load),
            "checkpoint " + a.path() + ": rank 1's piece of 'w' overlaps another piece with different "
            "values (first at element 2); the checkpoint's files were changed or mixed up");

  copy(data_file(agree, 1), rank1);  // [2, 8) agrees with rank 0's piece where they overlap
  EXPECT_TRUE(torch::equal(load(), torch::cat({torch::ones({4}), torch::full({4}, 2.0f)})));
}

// A rank whose data file cannot be written stops every rank with its
// reason (no rank waits at a barrier for it), and the checkpoint already in
// the directory stays the loadable one.
TEST_F(DistributedCheckpoint, AWriteFailureOnOneRankReachesEveryRankAndKeepsThePrevious) {
  testing::TempDir dir;
  auto errors = run_rank_contexts(3, [&](RankContext& ctx) {
    auto value = torch::full({4}, 1.0f);
    ckpt::DistributedState state;
    state.sharded["w"] = ckpt::ShardedTensor{value, 4 * ctx.rank, 12};
    state.metadata["version"] = "1";
    ckpt::save(dir.path(), state, ckpt::SaveOptions().process_group(ctx.group));
    value.fill_(2.0f);
    state.metadata["version"] = "2";
    ckpt::WriteFaults faults;
    if (ctx.rank == 2) faults.fsync_errno = EIO;
    try {
      ckpt::save(dir.path(), state, ckpt::SaveOptions().process_group(ctx.group).faults(faults));
      ADD_FAILURE() << "rank " << ctx.rank << ": a failed write was not reported";
    } catch (const Error& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "checkpoint::save " + dir.path() + ": rank 2: cannot save tensor file"));
      EXPECT_TRUE(testing::Contains(e.what(), "Input/output error"));
    }
    ckpt::load(dir.path(), state);
    EXPECT_EQ(state.metadata.at("version"), "1");
    EXPECT_TRUE(torch::equal(value, torch::full({4}, 1.0f))) << "rank " << ctx.rank;
  }, 30s);
  testing::expect_no_errors(errors);
}

// load() reads and checks everything before it writes anything.
TEST_F(DistributedCheckpoint, AFailedLoadLeavesTheStateUntouched) {
  testing::TempDir dir;
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    ckpt::DistributedState saved;
    saved.replicated["a"] = torch::full({3}, 1.0f);
    saved.sharded["b"] = ckpt::ShardedTensor{torch::full({2}, 1.0f), 2 * ctx.rank, 4};
    ckpt::save(dir.path(), saved, ckpt::SaveOptions().process_group(ctx.group));
    ckpt::DistributedState state;
    state.replicated["a"] = torch::full({3}, 7.0f);
    state.sharded["b"] = ckpt::ShardedTensor{torch::full({2}, 7.0f), 2 * ctx.rank, 4};
    state.sharded["c"] = ckpt::ShardedTensor{torch::full({2}, 7.0f), 0, 2};
    state.metadata["mine"] = "kept";
    try {
      ckpt::load(dir.path(), state);
      ADD_FAILURE() << "an entry the checkpoint lacks was loaded";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "has no sharded 'c'"));
    }
    EXPECT_TRUE(torch::equal(state.replicated["a"], torch::full({3}, 7.0f)));
    EXPECT_TRUE(torch::equal(state.sharded["b"].local, torch::full({2}, 7.0f)));
    state.sharded.erase("c");
    state.replicated["a"] = torch::full({3}, 7.0, torch::kDouble);
    try {
      ckpt::load(dir.path(), state);
      ADD_FAILURE() << "a double was loaded from a float";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "'a' is Float in the checkpoint but Double here"));
    }
    EXPECT_TRUE(torch::equal(state.replicated["a"], torch::full({3}, 7.0, torch::kDouble)));
    EXPECT_TRUE(torch::equal(state.sharded["b"].local, torch::full({2}, 7.0f)));
    EXPECT_EQ(state.metadata.at("mine"), "kept");
  }, 30s);
  testing::expect_no_errors(errors);
}

}  // namespace
}  // namespace dtrain
