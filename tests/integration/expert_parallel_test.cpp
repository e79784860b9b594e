// Mixture-of-experts layers across ranks (dtrain/expert_parallel.h), with
// thread ranks: each rank its own tokens, the experts split over the ranks,
// the dense parameters under DDP with the experts left alone; against one
// process training the same MoE on the whole batch.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <map>
#include <numeric>
#include <sstream>
#include <mutex>

#include "dtrain/ddp.h"
#include "dtrain/device_mesh.h"
#include "dtrain/fsdp.h"
#include "dtrain/dtrain.h"
#include "dtrain/expert_parallel.h"
#include "dtrain/checkpoint/distributed.h"
#include "harness/assertions.h"
#include "harness/optimizer_values.h"
#include "harness/temp_dir.h"
#include "harness/thread_ranks.h"

namespace dtrain::expert_parallel_test {  // (a namespace of its own: the test binary is a unity build)
namespace {

using namespace std::chrono_literals;
namespace ep = expert_parallel;
using testing::RankContext;
using testing::run_rank_contexts;

constexpr int kSteps = 5, kTokensPerRank = 6, kDim = 8, kSeed = 11;

ep::MoEOptions moe_options() {
  return ep::MoEOptions(kDim, 16, 8)
      .top_k(2)
      .shared_expert_hidden_dim(12)
      .score_func(ep::ScoreFunction::kSigmoid)
      .route_norm(true)
      .load_balance_coeff(1e-3);
}

// Rank r's tokens at `step` ([2, 3, dim]: two sequences of three), and its
// targets; one process trains on every rank's, in rank order. (Drawn
// before the ranks' threads start: libtorch's generator is the process's.)
std::mutex& generator() {  // libtorch's generator is the process's, and the ranks are threads
  static std::mutex m;
  return m;
}

std::pair<torch::Tensor, torch::Tensor> batch(int step, int rank) {
  static const auto all = [] {
    std::lock_guard<std::mutex> lock(generator());
    torch::manual_seed(1000);
    std::vector<std::pair<torch::Tensor, torch::Tensor>> out;
    for (int i = 0; i < kSteps * 4; ++i)
      out.emplace_back(torch::randn({2, kTokensPerRank / 2, kDim}), torch::randn({2, kTokensPerRank / 2, kDim}));
    return out;
  }();
  return all.at(step * 4 + rank);
}

// An MoE built from the seed, as every rank builds its own (one at a time:
// libtorch's generator is the process's, and the ranks are threads).
ep::MoE seeded_moe(const ep::MoEOptions& options) {
  std::lock_guard<std::mutex> lock(generator());
  torch::manual_seed(kSeed);
  return ep::MoE(options);
}

torch::Tensor loss_of(ep::MoE& moe, const torch::Tensor& x, const torch::Tensor& y) {
  return (moe(x) + x - y).pow(2).mean();
}

// Experts 6 and 7 are never chosen (their bias far below the others'):
// they get no token anywhere and must get zero gradients; at EP 4 they are
// all of rank 3's experts, which then runs on no rows at all.
void shun_experts_6_and_7(ep::MoE& moe) {
  torch::NoGradGuard no_grad;
  moe->expert_bias[6] = -100.0;
  moe->expert_bias[7] = -100.0;
}

// Everything one process ends with, by name (experts whole).
struct Trained {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> first_grads, params;
  torch::Tensor expert_bias;
};

Trained one_process(int world) {
  ep::MoE moe = seeded_moe(moe_options());
  shun_experts_6_and_7(moe);
  torch::optim::Adam adam(moe->parameters(), torch::optim::AdamOptions(1e-2));
  Trained t;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<torch::Tensor> xs, ys;
    for (int r = 0; r < world; ++r) {
      auto [x, y] = batch(step, r);
      xs.push_back(x);
      ys.push_back(y);
    }
    adam.zero_grad();
    auto loss = loss_of(moe, torch::cat(xs), torch::cat(ys));
    loss.backward();
    t.losses.push_back(loss.item<double>());
    if (step == 0)
      for (const auto& p : moe->named_parameters()) t.first_grads[p.key()] = p.value().grad().clone();
    adam.step();
    moe->update_expert_bias();
  }
  for (const auto& p : moe->named_parameters()) t.params[p.key()] = p.value().detach().clone();
  t.expert_bias = moe->expert_bias.clone();
  return t;
}

// `whole`'s part on this rank: the experts' slice, or all of it.
torch::Tensor part_of(const std::string& name, const torch::Tensor& whole, const ep::MoE& moe) {
  if (name.rfind("experts.", 0) != 0) return whole;
  return whole.narrow(0, moe->experts->first_expert(), moe->experts->local_experts());
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = std::max(want.abs().max().item<double>(), 1e-3);
  EXPECT_LE((got - want).abs().max().item<double>() / scale, 1e-5) << what << "\ngot " << got << "\nwant " << want;
}

class ExpertParallelRanks : public ::testing::TestWithParam<int> {};

// EP over P ranks, the dense parameters under DDP over the same ranks: the
// losses, the first step's gradients (the router's, the shared expert's,
// each expert's slice, zeros for experts 6 and 7, which at EP 4 are a
// rank's only ones) and the parameters and bias after 5 Adam steps equal
// one process's on the whole batch within 1e-5. (Experts skipped when
// they have no rows would leave such a rank's experts without a gradient,
// which Adam steps differently from a zero one: this catches it.)
TEST_P(ExpertParallelRanks, TrainAsOneProcessOnTheWholeBatch) {
  const int world = GetParam();
  const Trained want = one_process(world);
  auto errors = run_rank_contexts(world, [&](RankContext& ctx) {
    ep::MoE moe = seeded_moe(moe_options().ep_group(ctx.group));
    shun_experts_6_and_7(moe);
    DistributedDataParallel ddp(moe.ptr(), DDPOptions().process_group(ctx.group).params_and_buffers_to_ignore(
                                               ep::ignored_by_data_parallel(*moe)));
    torch::optim::Adam adam(moe->parameters(), torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step, ctx.rank);
      adam.zero_grad();
      auto loss = (ddp.forward(x) + x - y).pow(2).mean();
      loss.backward();
      auto mean_loss = loss.detach().clone();
      ctx.group->all_reduce(mean_loss)->wait();
      EXPECT_NEAR(mean_loss.item<double>() / world, want.losses[step], 1e-5 * want.losses[step])
          << "rank " << ctx.rank << " step " << step;
      if (step == 0)
        for (const auto& p : moe->named_parameters())
          expect_close(p.value().grad(), part_of(p.key(), want.first_grads.at(p.key()), moe),
                       "rank " + std::to_string(ctx.rank) + ": " + p.key() + "'s gradient");
      adam.step();
      moe->update_expert_bias(ctx.group);
    }
    for (const auto& p : moe->named_parameters())
      expect_close(p.value().detach(), part_of(p.key(), want.params.at(p.key()), moe),
                   "rank " + std::to_string(ctx.rank) + ": " + p.key());
    expect_close(moe->expert_bias, want.expert_bias, "expert_bias");
  }, 60s);
  testing::expect_no_errors(errors);
  // Experts 6 and 7 took no token: zero gradients, not undefined or NaN ones.
  EXPECT_TRUE(want.first_grads.at("experts.w1").narrow(0, 6, 2).eq(0).all().item<bool>());
  EXPECT_FALSE(want.first_grads.at("experts.w1")[0].eq(0).all().item<bool>());
}

INSTANTIATE_TEST_SUITE_P(Ep, ExpertParallelRanks, ::testing::Values(2, 4),
                         [](const auto& info) { return "ep" + std::to_string(info.param); });

// EP 2 x FSDP 2 on 4 ranks, torchtitan's efsdp: the mesh (edp 2, ep 2);
// the experts sharded by FSDP over the two ranks that hold the same ones
// (edp: their gradients averaged there), the router and the shared expert
// over all four. The losses, the parameters after 5 Adam steps (each
// rank's module through full_state_dict: the dense ones whole, the experts
// its slice) and the bias equal one process's on the whole batch within
// 1e-5; experts 6 and 7, all of the second EP rank's last pair, take no
// token. A module path FSDP cannot find is refused by name.
TEST(ExpertParallel, ExpertsShardedByFsdpOverTheRanksHoldingThemTrainAsOneProcess) {
  const Trained want = one_process(4);
  auto errors = run_rank_contexts(4, [&](RankContext& ctx) {
    DeviceMesh mesh({2, 2}, {"edp", "ep"}, testing::thread_mesh(ctx));
    ep::MoE moe = seeded_moe(moe_options().ep_group(mesh.get_group("ep")));
    shun_experts_6_and_7(moe);
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                FullyShardedDataParallel<ep::MoEImpl> bad(
                    moe.ptr(), FSDPOptions().process_group(ctx.group).submodule_groups({{"expert", mesh.get_group("edp")}}));
              }),
              "FullyShardedDataParallel: submodule_groups names 'expert', which is not a submodule of the model "
              "(named_modules() gives its paths)");
    FullyShardedDataParallel<ep::MoEImpl> fsdp(
        moe.ptr(), FSDPOptions().process_group(ctx.group).submodule_groups({{"experts", mesh.get_group("edp")}}));
    torch::optim::Adam adam(fsdp.parameters(), torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step, ctx.rank);
      adam.zero_grad();
      auto loss = (fsdp.forward(x) + x - y).pow(2).mean();
      loss.backward();
      auto mean_loss = loss.detach().clone();
      ctx.group->all_reduce(mean_loss)->wait();
      EXPECT_NEAR(mean_loss.item<double>() / 4, want.losses[step], 1e-5 * want.losses[step])
          << "rank " << ctx.rank << " step " << step;
      adam.step();
      moe->update_expert_bias(ctx.group);
    }
    const auto mine = fsdp.full_state_dict();
    for (const auto& [name, whole] : want.params)
      expect_close(mine.at(name), part_of(name, whole, moe), "rank " + std::to_string(ctx.rank) + ": " + name);
    expect_close(moe->expert_bias, want.expert_bias, "expert_bias");
    EXPECT_EQ(fsdp.shard_layout().size(), 2u) << "the root's unit and the experts'";
  }, 60s);
  testing::expect_no_errors(errors);
}

// The flight recorder's all-to-alls: per label, the numel of each entry.
std::map<std::string, std::vector<int64_t>> all_to_alls(const std::string& text) {
  std::map<std::string, std::vector<int64_t>> out;
  std::istringstream lines(text);
  std::string line;
  auto field = [&](const std::string& name) {  // the text after "name": up to the next , or }
    const auto at = line.find("\"" + name + "\": ");
    if (at == std::string::npos) return std::string();
    const auto from = at + name.size() + 4;
    std::string value = line.substr(from, line.find_first_of(",}", from) - from);
    if (!value.empty() && value.front() == '"') value = value.substr(1, value.size() - 2);
    return value;
  };
  while (std::getline(lines, line)) {
    if (field("op") != "all_to_all") continue;
    const auto label_at = line.find("\"label\": \"");
    const std::string label =
        label_at == std::string::npos ? "" : line.substr(label_at + 10, line.find('"', label_at + 10) - label_at - 10);
    out[label + " " + field("dtype")].push_back(std::stoll(field("numel")));
  }
  return out;
}

// Two MoE layers' forward and backward at EP 2, as the flight recorder saw
// them (both ranks' groups, in one process), each all-to-all labelled with
// its layer and what it carries. Per rank and layer: forward, one
// all-to-all of the counts (8 numbers), the routed rows there ("dispatch":
// tokens x top_k rows of dim floats) and back ("combine": the rows its
// experts got); backward, the same two the other way. So each layer's rows
// move, over both ranks, four times every rank's routed rows, whoever got
// them.
TEST(ExpertParallel, EachLayersAllToAllsAreLabelledCountedAndCarryTheRoutedRows) {
  testing::TempDir dir;
  std::string path;
  testing::expect_no_errors(run_rank_contexts(2, [&](RankContext& ctx) {
    ep::MoE first = seeded_moe(moe_options().ep_group(ctx.group).name("layers.0.moe"));
    ep::MoE second = seeded_moe(moe_options().ep_group(ctx.group).name("layers.1.moe"));
    auto [x0, y] = batch(0, ctx.rank);
    auto x = x0.clone().requires_grad_(true);  // (from an earlier layer: the dispatch's backward runs too)
    (second(first(x)) - y).pow(2).mean().backward();
    ctx.group->barrier()->wait();
    if (ctx.rank == 0) path = dump_flight_recorder(dir.path());
    ctx.group->barrier()->wait();
  }, 30s));
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const auto seen = all_to_alls(text.str());
  const int64_t routed = kTokensPerRank * 2 * kDim;  // one rank's rows, in floats
  std::vector<std::string> labels;
  for (const auto& [label, numels] : seen) labels.push_back(label);
  EXPECT_EQ(labels.size(), 2u * 5u) << text.str();
  for (const std::string layer : {"layers.0.moe", "layers.1.moe"}) {
    EXPECT_EQ(seen.count(layer + ": counts Long") ? seen.at(layer + ": counts Long") : std::vector<int64_t>{},
              (std::vector<int64_t>{8, 8}))
        << layer;
    int64_t moved = 0;
    for (const std::string what : {"dispatch", "combine", "dispatch, backward", "combine, backward"}) {
      const auto it = seen.find(layer + ": " + what + " Float");
      ASSERT_NE(it, seen.end()) << layer << ": " << what << "\n" << text.str();
      ASSERT_EQ(it->second.size(), 2u) << layer << ": " << what << " (one per rank)";
      moved += it->second[0] + it->second[1];
      if (what == "dispatch" || what == "combine, backward")
        EXPECT_EQ(it->second, (std::vector<int64_t>{routed, routed})) << layer << ": each rank sends its own rows";
    }
    EXPECT_EQ(moved, 4 * 2 * routed) << layer;
  }
}

using Params = testing::NamedTensors;

using testing::exp_avg_of;
using testing::params_of;

checkpoint::DistributedState state_of(ep::MoE& moe, torch::optim::Optimizer& opt) {
  checkpoint::DistributedState state;
  checkpoint::add_module(state, *moe);
  checkpoint::add_optimizer(state, opt, *moe);
  return state;
}

// `mine` equals this rank's part of `whole` (experts sliced), bitwise.
void expect_parts_of(const Params& whole, const Params& mine, const ep::MoE& moe, const std::string& what) {
  ASSERT_EQ(mine.size(), whole.size()) << what;
  for (const auto& [name, value] : mine)
    EXPECT_TRUE(at::equal(value, part_of(name, whole.at(name), moe))) << what << ": " << name;
}

// The experts go into a checkpoint as boxes of the whole [E, ...] tensors
// (their placements), Adam's moments with them: saved at EP 4 after two
// steps, it loads bitwise into one process (each rank's experts in its
// place) and at EP 2.
TEST(ExpertParallel, ACheckpointSavedAtEp4LoadsBitwiseInOneProcessAndAtEp2) {
  testing::TempDir dir;
  std::vector<Params> saved(4), moments(4);
  std::vector<int64_t> first(4);
  testing::expect_no_errors(run_rank_contexts(4, [&](RankContext& ctx) {
    ep::MoE moe = seeded_moe(moe_options().ep_group(ctx.group));
    DistributedDataParallel ddp(moe.ptr(), DDPOptions().process_group(ctx.group).params_and_buffers_to_ignore(
                                               ep::ignored_by_data_parallel(*moe)));
    torch::optim::Adam adam(moe->parameters(), torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < 2; ++step) {
      auto [x, y] = batch(step, ctx.rank);
      adam.zero_grad();
      (ddp.forward(x) + x - y).pow(2).mean().backward();
      adam.step();
    }
    auto state = state_of(moe, adam);
    checkpoint::save(dir.path(), state, checkpoint::SaveOptions().process_group(ctx.group));
    saved[ctx.rank] = params_of(*moe);
    moments[ctx.rank] = exp_avg_of(adam, *moe);
    first[ctx.rank] = moe->experts->first_expert();
  }, 60s));
  ep::MoE whole = seeded_moe(moe_options());
  {
    torch::NoGradGuard no_grad;
    for (auto& p : whole->parameters()) p.add_(1.0);  // other values than the seed's
  }
  torch::optim::Adam whole_adam(whole->parameters(), torch::optim::AdamOptions(1e-2));
  auto whole_state = state_of(whole, whole_adam);
  checkpoint::load(dir.path(), whole_state);
  const Params loaded = params_of(*whole), loaded_moments = exp_avg_of(whole_adam, *whole);
  for (int r = 0; r < 4; ++r)
    for (const auto& [name, value] : saved[r]) {
      const auto& in_whole = loaded.at(name);
      const bool expert = name.rfind("experts.", 0) == 0;
      EXPECT_TRUE(at::equal(value, expert ? in_whole.narrow(0, first[r], 2) : in_whole)) << "rank " << r << ": " << name;
      const auto& m = loaded_moments.at(name);
      EXPECT_TRUE(at::equal(moments[r].at(name), expert ? m.narrow(0, first[r], 2) : m))
          << "rank " << r << "'s exp_avg: " << name;
    }
  testing::expect_no_errors(run_rank_contexts(2, [&](RankContext& ctx) {
    ep::MoE moe = seeded_moe(moe_options().ep_group(ctx.group));
    torch::optim::Adam adam(moe->parameters(), torch::optim::AdamOptions(1e-2));
    auto state = state_of(moe, adam);
    checkpoint::load(dir.path(), state);
    expect_parts_of(loaded, params_of(*moe), moe, "EP 2's rank " + std::to_string(ctx.rank));
    expect_parts_of(loaded_moments, exp_avg_of(adam, *moe), moe, "EP 2's rank " + std::to_string(ctx.rank) + "'s exp_avg");
  }, 60s));
}

// Experts that do not split over the group, top_k out of range, and ranks
// of one EP group holding different layers: an InvalidArgument naming the
// module and the numbers, on every rank.
TEST(ExpertParallel, BadSizesAreRefusedNamingTheNumbers) {
  auto errors = run_rank_contexts(4, [&](RankContext& ctx) {
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { ep::MoE(ep::MoEOptions(8, 16, 6).ep_group(ctx.group)); }),
              "expert_parallel::MoE: 6 experts do not split over the 4 ranks of group '" + ctx.group->name() + "'");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { ep::MoE(ep::MoEOptions(8, 16, 8).top_k(9)); }),
              "expert_parallel::MoE: top_k 9 must be in 1..num_experts (8)");
  }, 30s);
  testing::expect_no_errors(errors);
  // Ranks of one EP group building different layers (here 8 experts on
  // rank 0, 4 on rank 1): their dispatches could not match, so every rank
  // refuses at its first forward, naming what each holds.
  errors = run_rank_contexts(2, [&](RankContext& ctx) {
    ep::MoE moe(ep::MoEOptions(8, 16, ctx.rank == 0 ? 8 : 4).ep_group(ctx.group));
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { moe(torch::zeros({3, 8})); }),
              "expert_parallel::MoE: the model differs across ranks at parameter #0: rank 0 has 'router.gate.weight' "
              "Float [8, 8]; rank 1 has 'router.gate.weight' Float [4, 8]. Every rank must wrap the same model: the "
              "same parameter names, dtypes and shapes, registered in the same order.");
  }, 30s);
  testing::expect_no_errors(errors);
}

// A peer whose rows do not match the counts it announced (a bug or a
// corrupted peer: rank 1 plays it by hand, announcing 5 rows for each of
// rank 0's experts and sending 3): rank 0's dispatch fails naming the
// exchange and the sizes, rather than reading rows that never came, and
// keeps the transport's error type (CollectiveMismatch).
TEST(ExpertParallel, APeerWhoseRowsDoNotMatchItsAnnouncedCountsFailsTheDispatchByName) {
  std::string seen;
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    if (ctx.rank == 0) {
      ep::MoE moe = seeded_moe(moe_options().ep_group(ctx.group));
      const auto x = torch::randn({6, kDim});
      try {  // (the dispatch alone: the layer's first forward would compare the ranks' layers first)
        ep::dispatch_and_combine(x, moe->router(x, moe->expert_bias), *moe->experts, ctx.group, "layers.0.moe");
        ADD_FAILURE() << "rank 0's dispatch took rows that do not match rank 1's counts";
      } catch (const CollectiveMismatch& e) {
        seen = e.what();
      } catch (const Error& e) {
        ADD_FAILURE() << "not a CollectiveMismatch: " << e.what();
      }
      return;
    }
    auto counts = torch::full({8}, 5, torch::kLong);  // 5 rows for each expert: 20 for rank 0's four
    auto got = torch::empty({8}, torch::kLong);
    ctx.group->all_to_all({got.narrow(0, 0, 4), got.narrow(0, 4, 4)}, {counts.narrow(0, 0, 4), counts.narrow(0, 4, 4)})
        ->wait();
    const int64_t back = got.narrow(0, 0, 4).sum().item<int64_t>();  // the rows rank 0 sends rank 1's experts
    auto mine = torch::zeros({20, kDim});
    auto rows_in = torch::empty({back + 20, kDim});
    try {
      ctx.group->all_to_all({rows_in.narrow(0, 0, back), rows_in.narrow(0, back, 20)},
                            {torch::zeros({3, kDim}), mine})
          ->wait();
    } catch (const Error&) {
      // (rank 0's failure may fail the group under this rank too)
    }
  }, 30s);
  testing::expect_no_errors(errors);
  EXPECT_TRUE(testing::Contains(seen, "layers.0.moe: dispatch")) << seen;
  EXPECT_TRUE(testing::Contains(seen, "sent 96 bytes where this rank expected 640")) << seen;  // 3 rows, not 20
}

// A DDP told to ignore a name the module lacks says so (a typo would
// otherwise average an expert's parameters over ranks that each hold
// different experts).
TEST(ExpertParallel, DdpRefusesToIgnoreANameTheModuleLacks) {
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    ep::MoE moe(moe_options().ep_group(ctx.group));
    auto names = ep::ignored_by_data_parallel(*moe);
    EXPECT_EQ(names, (std::vector<std::string>{"tokens_per_expert", "experts.w1", "experts.w2", "experts.w3"}));
    names.push_back("experts.w4");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] {
                DistributedDataParallel ddp(moe.ptr(),
                                            DDPOptions().process_group(ctx.group).params_and_buffers_to_ignore(names));
              }),
              "DistributedDataParallel: params_and_buffers_to_ignore names 1 of its 5 entries that the module does "
              "not have: experts.w4");
  }, 30s);
  testing::expect_no_errors(errors);
}

}  // namespace
}  // namespace dtrain::expert_parallel_test
