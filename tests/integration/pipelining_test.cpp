// Pipeline parallelism against one process: every schedule, at 2 and 4
// stages, with SGD and Adam, ends at the parameters of one process trained
// on the whole batch; and what a user gets wrong is named.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <string>
#include <thread>

#include "harness/assertions.h"
#include "harness/thread_ranks.h"
#include "harness/training.h"

namespace dtrain {
namespace {

namespace pp = pipelining;
using namespace std::chrono_literals;
using testing::Contains;
using testing::expect_no_errors;
using testing::RankContext;
using testing::run_rank_contexts;

constexpr int kPipeWidth = 12;
constexpr int kPipeRows = 16;
constexpr int kPipeSteps = 5;

// Eight children: a Linear and a Tanh per layer, so that any cut works.
torch::nn::Sequential make_model() {
  torch::manual_seed(7);
  torch::nn::Sequential m;
  for (int i = 0; i < 4; ++i) {
    m->push_back(torch::nn::Linear(kPipeWidth, kPipeWidth));
    m->push_back(torch::nn::Functional(torch::tanh));
  }
  return m;
}

std::vector<testing::Batch> make_batches() {
  torch::manual_seed(11);
  std::vector<testing::Batch> data;
  for (int s = 0; s < kPipeSteps; ++s)
    data.push_back({torch::randn({kPipeRows, kPipeWidth}), torch::randn({kPipeRows, kPipeWidth})});
  return data;
}

at::Tensor mse(const at::Tensor& out, const at::Tensor& target) {
  return torch::mse_loss(out, target);
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(bool adam,
                                                        std::vector<torch::Tensor> params) {
  if (adam)
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
}

// Each child's parameters after `kPipeSteps` steps of one process on the whole
// batch.
std::vector<std::vector<at::Tensor>> reference(bool adam) {
  auto model = make_model();
  auto opt = make_optimizer(adam, model->parameters());
  for (const auto& b : make_batches()) {
    opt->zero_grad();
    mse(model->forward(b.x), b.y).backward();
    opt->step();
  }
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& child : model->children()) out.push_back(child->parameters());
  return out;
}

double relative_difference(const std::vector<at::Tensor>& got,
                           const std::vector<at::Tensor>& want) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    diff = std::max(diff, (got[i] - want[i]).abs().max().item<double>());
    scale = std::max(scale, want[i].abs().max().item<double>());
  }
  return diff / scale;
}

enum class Kind { GPIPE, ONE_F_ONE_B, INTERLEAVED, LOOPED_BFS, ZBV };

const char* name_of(Kind k) {
  switch (k) {
    case Kind::GPIPE: return "GPipe";
    case Kind::ONE_F_ONE_B: return "1F1B";
    case Kind::INTERLEAVED: return "Interleaved1F1B";
    case Kind::LOOPED_BFS: return "LoopedBFS";
    case Kind::ZBV: return "ZBVZeroBubble";
  }
  return "?";
}

std::unique_ptr<pp::PipelineSchedule> make_schedule(Kind kind, std::vector<pp::PipelineStage> s,
                                                    int m) {
  switch (kind) {
    case Kind::GPIPE: return std::make_unique<pp::ScheduleGPipe>(s[0], m, mse);
    case Kind::ONE_F_ONE_B: return std::make_unique<pp::Schedule1F1B>(s[0], m, mse);
    case Kind::INTERLEAVED: return std::make_unique<pp::ScheduleInterleaved1F1B>(s, m, mse);
    case Kind::LOOPED_BFS: return std::make_unique<pp::ScheduleLoopedBFS>(s, m, mse);
    case Kind::ZBV: return std::make_unique<pp::ScheduleZBVZeroBubble>(s, m, mse);
  }
  return nullptr;
}

// Trains `stages` stages over `ranks` thread ranks and compares each rank's
// children with the reference's.
void expect_equivalent(Kind kind, int ranks, int stages, int m, bool adam,
                       const std::string& backend = "tcp") {
  SCOPED_TRACE(std::string(name_of(kind)) + " ranks=" + std::to_string(ranks) +
               " stages=" + std::to_string(stages) + " m=" + std::to_string(m) +
               (adam ? " Adam" : " SGD") + " " + backend);
  const auto want = reference(adam);
  const auto data = make_batches();
  std::vector<torch::nn::Sequential> models;
  for (int r = 0; r < ranks; ++r) models.push_back(make_model());
  expect_no_errors(run_rank_contexts(
      ranks,
      [&](RankContext& ctx) {
        const int r = ctx.rank;
        auto pieces = pp::split_sequential(models[r], stages);
        std::vector<pp::PipelineStage> mine;
        std::vector<int> children;  // the model's child indices this rank holds
        const int per = 8 / stages;
        // Stage s on rank s mod ranks; for ZB-V, ranks r and 2 ranks - 1 - r.
        std::vector<int> held;
        for (int s = r; s < stages; s += ranks) held.push_back(s);
        if (kind == Kind::ZBV) held = {r, 2 * ranks - 1 - r};
        for (int s : held) {
          mine.emplace_back(pieces[s], s, stages, pp::PipelineStageOptions().group(ctx.group));
          for (int c = s * per; c < (s + 1) * per; ++c) children.push_back(c);
        }
        std::vector<torch::Tensor> params;
        for (const auto& st : mine)
          for (const auto& p : st.module()->parameters()) params.push_back(p);
        auto opt = make_optimizer(adam, params);
        auto schedule = make_schedule(kind, mine, m);
        const bool first = r == 0;
        const bool last = kind == Kind::ZBV ? r == 0 : (stages - 1) % ranks == r;
        for (const auto& b : data) {
          opt->zero_grad();
          std::vector<at::Tensor> losses;
          if (first && last) schedule->step(b.x, b.y, &losses);
          else if (first) schedule->step(b.x);
          else if (last) schedule->step(b.y, &losses);
          else schedule->step();
          if (last) {
            ASSERT_EQ(losses.size(), static_cast<size_t>(m));
            EXPECT_TRUE(losses[0].defined());
          }
          opt->step();
        }
        for (int c : children) {
          auto got = models[r]->children()[c]->parameters();
          if (got.empty()) continue;  // a Tanh
          EXPECT_LE(relative_difference(got, want[c]), 1e-5) << "child " << c << " on rank " << r;
        }
      },
      60s, GroupOptions(), backend));
}

TEST(Pipelining, GPipeAnd1F1BEqualOneProcessAt2And4Stages) {
  for (auto kind : {Kind::GPIPE, Kind::ONE_F_ONE_B})
    for (int stages : {2, 4})
      for (int m : {4, 8})
        for (bool adam : {false, true}) expect_equivalent(kind, stages, stages, m, adam);
}

// Two stages per rank: 2 stages on one rank (handed over in memory) and 4
// stages on 2 ranks.
TEST(Pipelining, InterleavedAndLoopedBFSEqualOneProcessAt2And4Stages) {
  for (auto kind : {Kind::INTERLEAVED, Kind::LOOPED_BFS})
    for (int stages : {2, 4})
      for (int m : {4, 8})
        for (bool adam : {false, true}) expect_equivalent(kind, stages / 2, stages, m, adam);
}

// Zero bubble: 2 stages on one rank and 4 stages on 2 ranks (a V: rank 0
// holds stages 0 and 3), each backward split into its two halves.
TEST(Pipelining, ZeroBubbleEqualsOneProcessAt2And4Stages) {
  for (int stages : {2, 4})
    for (int m : {4, 8})
      for (bool adam : {false, true}) expect_equivalent(Kind::ZBV, stages / 2, stages, m, adam);
}

TEST(Pipelining, OtherTransportsGiveTheSameParameters) {
  expect_equivalent(Kind::ONE_F_ONE_B, 2, 2, 4, true, "shm");
  expect_equivalent(Kind::INTERLEAVED, 2, 4, 4, false, "auto@2");
}

// eval runs the forwards only: the last stage's output is the model's, the
// losses the microbatches', and no gradient appears.
TEST(Pipelining, EvalReturnsTheModelsOutputAndLeavesNoGradient) {
  auto whole = make_model();
  const auto data = make_batches();
  const auto want = whole->forward(data[0].x);
  std::vector<torch::nn::Sequential> models{make_model(), make_model()};
  expect_no_errors(run_rank_contexts(2, [&](RankContext& ctx) {
    auto piece = pp::split_sequential(models[ctx.rank], 2)[ctx.rank];
    pp::PipelineStage stage(piece, ctx.rank, 2, pp::PipelineStageOptions().group(ctx.group));
    pp::ScheduleGPipe schedule(stage, 4, mse);
    std::vector<at::Tensor> losses;
    auto out = ctx.rank == 0 ? schedule.eval(data[0].x) : schedule.eval(data[0].y, &losses);
    for (const auto& p : piece->parameters()) EXPECT_FALSE(p.grad().defined());
    if (ctx.rank == 0) {
      EXPECT_FALSE(out.defined());
      return;
    }
    EXPECT_TRUE(torch::allclose(out, want, 1e-6, 1e-6));
    ASSERT_EQ(losses.size(), 4u);
    for (int i = 0; i < 4; ++i)
      EXPECT_NEAR(losses[i].item<double>(),
                  mse(want.chunk(4)[i], data[0].y.chunk(4)[i]).item<double>(), 1e-6);
  }));
}

TEST(Pipelining, SplitSequentialCutsEvenlyOrAtPointsKeepingNames) {
  auto model = make_model();
  torch::nn::Sequential seven;
  for (int i = 0; i < 7; ++i) seven->push_back(torch::nn::Linear(2, 2));
  auto pieces = pp::split_sequential(seven, 3);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0]->size(), 3u);
  EXPECT_EQ(pieces[1]->size(), 2u);
  EXPECT_EQ(pieces[2]->size(), 2u);
  EXPECT_EQ(pieces[2]->named_parameters().keys(),
            (std::vector<std::string>{"5.weight", "5.bias", "6.weight", "6.bias"}));
  // The pieces share the model's parameters.
  EXPECT_EQ(pieces[1]->parameters()[0].data_ptr(), seven->parameters()[6].data_ptr());
  auto at = pp::split_sequential(model, std::vector<int>{2, 6});
  EXPECT_EQ(at[0]->size(), 2u);
  EXPECT_EQ(at[1]->size(), 4u);
  EXPECT_EQ(at[2]->size(), 2u);
  EXPECT_EQ(testing::what_thrown<InvalidArgument>(
      [&] { pp::split_sequential(model, 9); }),
      "split_sequential: num_stages 9 must lie in 1..8 (the model has 8 children)");
  EXPECT_EQ(testing::what_thrown<InvalidArgument>(
      [&] { pp::split_sequential(model, std::vector<int>{4, 2}); }),
      "split_sequential: split points [4, 2] must increase and lie in 1..7 (the model has 8 "
      "children)");
}

// Ranks that run different schedules or microbatch counts are refused at
// the first step, every rank naming what each runs.
TEST(Pipelining, MismatchedSchedulesAreRefusedAtTheFirstStepNamingThem) {
  std::vector<torch::nn::Sequential> models{make_model(), make_model()};
  const auto x = torch::randn({8, kPipeWidth});
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    auto piece = pp::split_sequential(models[ctx.rank], 2)[ctx.rank];
    pp::PipelineStage stage(piece, ctx.rank, 2, pp::PipelineStageOptions().group(ctx.group));
    std::unique_ptr<pp::PipelineSchedule> s;
    if (ctx.rank == 0) s = std::make_unique<pp::Schedule1F1B>(stage, 4, mse);
    else s = std::make_unique<pp::ScheduleGPipe>(stage, 8, mse);
    if (ctx.rank == 0) s->step(x);
    else s->step(x);
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(errors[r], "pipelining: the ranks of group 'default' run different schedules: "
                         "rank 0: Schedule1F1B, stage(s) 0 of 2, 4 microbatches; rank 1: "
                         "ScheduleGPipe, stage(s) 1 of 2, 8 microbatches")
        << "rank " << r;
}

TEST(Pipelining, WrongCallsAndPlacementsAreNamed) {
  std::vector<torch::nn::Sequential> models{make_model(), make_model()};
  const auto x = torch::randn({8, kPipeWidth});
  expect_no_errors(run_rank_contexts(2, [&](RankContext& ctx) {
    const int r = ctx.rank;
    auto piece = pp::split_sequential(models[r], 2)[r];
    auto opts = pp::PipelineStageOptions().group(ctx.group);
    EXPECT_EQ(testing::what_thrown<InvalidArgument>(
        [&] { pp::Schedule1F1B(pp::PipelineStage(piece, 1 - r, 2, opts), 4, mse); }),
        "Schedule1F1B: stage " + std::to_string(1 - r) + " belongs on rank " +
            std::to_string(1 - r) + " of group 'default' (stage s on rank s mod p, p = 2), but rank " +
            std::to_string(r) + " holds it");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>(
        [&] { pp::Schedule1F1B(pp::PipelineStage(piece, r, 3, opts), 4, mse); }),
        "Schedule1F1B: 3 stages over group 'default' of 2 ranks with 1 stage(s) on this rank; "
        "this schedule needs num_stages = ranks x stages per rank, 2");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>(
        [&] { pp::PipelineStage(piece, 2, 2, opts); }),
        "PipelineStage: stage_index 2 must lie in 0..1 (num_stages 2)");
    pp::Schedule1F1B schedule(pp::PipelineStage(piece, r, 2, opts), 4, mse);
    if (r == 0) {
      EXPECT_EQ(testing::what_thrown<InvalidArgument>(
          [&] { schedule.step(); }),
          "Schedule1F1B.step: rank 0 holds stage(s) 0 of 2, the first, which needs the input: "
          "call step(input, ...)");
      EXPECT_EQ(testing::what_thrown<InvalidArgument>(
          [&] { schedule.step(torch::randn({6, kPipeWidth})); }),
          "Schedule1F1B.step: dim 0 (6) of the input does not split into 4 equal microbatches");
    } else {
      EXPECT_EQ(testing::what_thrown<InvalidArgument>(
          [&] { schedule.step(); }),
          "Schedule1F1B.step: rank 1 holds stage(s) 1 of 2, the last, which needs the target "
          "for the loss: call step(target, &losses)");
    }
    // After refused calls, a good step runs.
    if (r == 0) schedule.step(x);
    else schedule.step(x);
  }));
}

// The schedules' messages use tags of their own (from 2^28 on a backend
// whose tags reach INT_MAX): a program's send or recv there, which could
// take a pipeline's message, is refused naming the range; below it, it
// goes through.
TEST(Pipelining, TheSchedulesTagsAreRefusedToTheUsersSendsAndRecvs) {
  testing::expect_no_errors(testing::run_ranks(2, [&](ProcessGroup& g) {
    EXPECT_EQ(g.max_tag(), std::numeric_limits<int>::max());
    EXPECT_EQ(g.internal_tags_from(), 1 << 28);
    auto t = at::zeros({4});
    const std::string refused = "tag 268435456 is one of dtrain's own on group 'default' "
                                "(268435456 to 2147483647: pipeline schedules use them); use a "
                                "tag below 268435456";
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { g.send(t, 1 - g.rank(), 1 << 28); }),
              "send: " + refused);
    EXPECT_TRUE(Contains(
        testing::what_thrown<InvalidArgument>([&] { g.recv(t, 1 - g.rank(), 1 << 28); }), refused));
    auto r = g.recv(t, 1 - g.rank(), (1 << 28) - 1);
    g.send(at::full({4}, float(g.rank())), 1 - g.rank(), (1 << 28) - 1)->wait();
    r->wait();
    EXPECT_TRUE(at::equal(t, at::full({4}, float(1 - g.rank()))));
  }, 20s, GroupOptions(), "tcp"));
}

// A stage that stops answering fails its neighbours within the timeout,
// each naming the stage and microbatch it waited for.
TEST(Pipelining, AStalledStageFailsTheOtherRanksNamingIt) {
  std::vector<torch::nn::Sequential> models{make_model(), make_model(), make_model()};
  const auto x = torch::randn({8, kPipeWidth});
  std::vector<double> seconds(3);
  auto errors = run_rank_contexts(
      3,
      [&](RankContext& ctx) {
        const int r = ctx.rank;
        auto piece = pp::split_sequential(models[r], std::vector<int>{2, 4})[r];
        pp::PipelineStage stage(piece, r, 3, pp::PipelineStageOptions().group(ctx.group));
        pp::Schedule1F1B schedule(stage, 4, mse);
        for (int step = 0; step < 2; ++step) {
          if (r == 1 && step == 1) {  // stalls in its second step
            std::this_thread::sleep_for(3s);
            return;
          }
          const auto begin = std::chrono::steady_clock::now();
          try {
            if (r == 0) schedule.step(x);
            else if (r == 2) schedule.step(x, nullptr);
            else schedule.step();
          } catch (const Error&) {
            seconds[r] = testing::seconds_since(begin);
            throw;
          }
        }
      },
      1500ms);
  EXPECT_TRUE(errors[1].empty()) << errors[1];
  // Within the 1.5 s timeout (and the stalled rank's 3 s).
  EXPECT_LT(seconds[0], 1.5 * testing::kSanitizerSlowdown + 1.4);
  EXPECT_LT(seconds[2], 1.5 * testing::kSanitizerSlowdown + 1.4);
  EXPECT_TRUE(Contains(errors[0], "pipeline stage 0 (rank 0 of group 'default'), microbatch 0: "
                                  "waiting for stage 1's gradient: "))
      << errors[0];
  EXPECT_TRUE(Contains(errors[2], "pipeline stage 2 (rank 2 of group 'default'), microbatch 0: "
                                  "waiting for stage 1's output"))
      << errors[2];
}

// A healthy step longer than the group's timeout: stage 1's forward takes
// 300 ms a microbatch, so 8 microbatches take 2.4 s under a 1.5 s timeout,
// and the gradient of microbatch 7 reaches stage 0 ~2.4 s after the step
// began. No wait lasts longer than ~0.7 s: a receive's timeout counts from
// its first wait, not from when the runner posted it (which was the step's
// start, and failed this step with a TimeoutError).
TEST(Pipelining, AStepLongerThanTheTimeoutSucceedsWhenEveryWaitIsShort) {
  std::vector<torch::nn::Sequential> models{make_model(), make_model()};
  const auto x = torch::randn({8, kPipeWidth}), y = torch::randn({8, kPipeWidth});
  std::vector<double> seconds(2);
  testing::expect_no_errors(run_rank_contexts(
      2,
      [&](RankContext& ctx) {
        const int r = ctx.rank;
        auto piece = pp::split_sequential(models[r], 2)[r];
        if (r == 1)
          piece->push_back("slow", torch::nn::Functional([](at::Tensor t) {
            std::this_thread::sleep_for(300ms);
            return t;
          }));
        pp::PipelineStage stage(piece, r, 2, pp::PipelineStageOptions().group(ctx.group));
        pp::Schedule1F1B schedule(stage, 8, mse);
        const auto begin = std::chrono::steady_clock::now();
        std::vector<at::Tensor> losses;
        if (r == 0) schedule.step(x);
        else schedule.step(y, &losses);
        seconds[r] = testing::seconds_since(begin);
        if (r == 1) EXPECT_EQ(losses.size(), 8u);
      },
      1500ms, GroupOptions(), "tcp"));
  EXPECT_GT(seconds[0], 2.4);  // the step did outlast the timeout
}

// Steps may differ in batch size (each step learns its shapes): a step of
// 8 rows, then an eval of 6, give the model's outputs.
TEST(Pipelining, StepsMayDifferInBatchSize) {
  auto whole = make_model();
  std::vector<torch::nn::Sequential> models{make_model(), make_model()};
  const auto x8 = torch::randn({8, kPipeWidth}), x6 = torch::randn({6, kPipeWidth});
  const auto want8 = whole->forward(x8), want6 = whole->forward(x6);
  expect_no_errors(run_rank_contexts(2, [&](RankContext& ctx) {
    auto piece = pp::split_sequential(models[ctx.rank], 2)[ctx.rank];
    pp::PipelineStage stage(piece, ctx.rank, 2, pp::PipelineStageOptions().group(ctx.group));
    pp::Schedule1F1B schedule(stage, 2, mse);
    auto out8 = ctx.rank == 0 ? schedule.eval(x8) : schedule.eval();
    auto out6 = ctx.rank == 0 ? schedule.eval(x6) : schedule.eval();
    if (ctx.rank == 0) return;
    EXPECT_TRUE(torch::allclose(out8, want8, 1e-6, 1e-6));
    EXPECT_TRUE(torch::allclose(out6, want6, 1e-6, 1e-6));
  }));
}

// A stage whose microbatches' outputs differ in shape within a step names
// itself and the microbatch (its successor, waiting, fails by its timeout).
TEST(Pipelining, MicrobatchOutputsOfDifferentShapesAreNamed) {
  std::vector<torch::nn::Sequential> models{make_model(), make_model()};
  auto errors = run_rank_contexts(
      2,
      [&](RankContext& ctx) {
        auto piece = pp::split_sequential(models[ctx.rank], 2)[ctx.rank];
        int calls = 0;  // the second microbatch loses a row
        auto shrinking = torch::nn::AnyModule(torch::nn::Functional([&](at::Tensor x) {
          auto y = piece->forward(x);
          return calls++ == 1 ? y.narrow(0, 0, y.size(0) - 1) : y;
        }));
        const auto opts = pp::PipelineStageOptions().group(ctx.group);
        auto stage = ctx.rank == 0 ? pp::PipelineStage(shrinking, 0, 2, opts)
                                   : pp::PipelineStage(piece, 1, 2, opts);
        pp::ScheduleGPipe schedule(stage, 2, mse);
        const auto x = torch::randn({8, kPipeWidth});
        if (ctx.rank == 0) schedule.step(x);
        else schedule.step(x, nullptr);
      },
      1500ms);
  EXPECT_EQ(errors[0], "pipeline stage 0 (rank 0 of group 'default'), microbatch 1: the stage's "
                       "output is Float [3, 12] but microbatch 0's was Float [4, 12], which "
                       "stage 1 was told to expect; the microbatches of a step must have one "
                       "shape");
  EXPECT_TRUE(Contains(errors[1], "waiting for stage 0's output")) << errors[1];
}

}  // namespace
}  // namespace dtrain
