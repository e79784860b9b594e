// SyncBatchNorm: N ranks holding slices of a batch give the outputs, input
// gradients, weight/bias gradients (summed over ranks) and running
// statistics of one BatchNorm over the whole batch, step after step, for
// 1d/2d/3d, even and uneven slices (an empty one included), on tcp and shm;
// inside DDP it trains like single-process BatchNorm; eval mode sends
// nothing; convert_sync_batchnorm keeps the BatchNorm's tensors and names
// what it cannot swap.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>
#include <numeric>

#include "dtrain/dtrain.h"
#include "harness/assertions.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::Contains;
using testing::RankContext;
using testing::run_rank_contexts;

constexpr int kChannels = 3;
constexpr int kSbnSteps = 20;
constexpr double kTol = 1e-5;

std::shared_ptr<torch::nn::Module> reference_norm(size_t dims,
                                                  const torch::nn::BatchNormOptions& o) {
  if (dims == 1) return torch::nn::BatchNorm1d(o).ptr();
  if (dims == 2) return torch::nn::BatchNorm2d(o).ptr();
  return torch::nn::BatchNorm3d(o).ptr();
}

torch::Tensor forward_any(const std::shared_ptr<torch::nn::Module>& m, const torch::Tensor& x) {
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(m)) return bn->forward(x);
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(m)) return bn->forward(x);
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm3dImpl>(m)) return bn->forward(x);
  if (auto s = std::dynamic_pointer_cast<SyncBatchNormImpl<1>>(m)) return s->forward(x);
  if (auto s = std::dynamic_pointer_cast<SyncBatchNormImpl<2>>(m)) return s->forward(x);
  return std::dynamic_pointer_cast<SyncBatchNormImpl<3>>(m)->forward(x);
}

std::shared_ptr<torch::nn::Module> sync_norm(size_t dims, const torch::nn::BatchNormOptions& o,
                                             std::shared_ptr<ProcessGroup> group) {
  if (dims == 1) return SyncBatchNorm1d(o, group).ptr();
  if (dims == 2) return SyncBatchNorm2d(o, group).ptr();
  return SyncBatchNorm3d(o, group).ptr();
}

// Batch of `n` samples for a norm of `dims` spatial dimensions.
torch::Tensor batch(size_t dims, int64_t n) {
  std::vector<int64_t> shape{n, kChannels};
  for (size_t d = 0; d < dims; ++d) shape.push_back(3 + static_cast<int64_t>(d));
  if (dims == 1) shape.pop_back();  // (N, C): BatchNorm1d's plain form
  return torch::randn(shape) * 2 + 0.5;
}

::testing::AssertionResult close(const torch::Tensor& a, const torch::Tensor& b, const char* what) {
  if (a.sizes() != b.sizes())
    return ::testing::AssertionFailure() << what << ": shapes " << a.sizes() << " vs " << b.sizes();
  if (a.numel() == 0 || torch::allclose(a, b, kTol, kTol)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": max difference "
                                       << (a - b).abs().max().item<double>();
}

struct Case {
  std::string backend;
  size_t dims;
  std::vector<int64_t> slices;  // batch rows per rank
  bool cumulative;              // momentum unset: a cumulative average
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.backend << " " << c.dims << "d slices " << ::testing::PrintToString(c.slices)
      << (c.cumulative ? " cumulative" : "");
}

class SyncBatchNormEquivalence : public ::testing::TestWithParam<Case> {};

// Every rank runs the reference over the whole batch itself, then its
// SyncBatchNorm over its slice, and compares.
TEST_P(SyncBatchNormEquivalence, MatchesBatchNormOnTheConcatenatedBatch) {
  const Case c = GetParam();
  const int world = static_cast<int>(c.slices.size());
  const int64_t total = std::accumulate(c.slices.begin(), c.slices.end(), int64_t{0});
  auto options = torch::nn::BatchNormOptions(kChannels);
  if (c.cumulative) options.momentum(c10::nullopt);
  // Ranks are threads sharing torch's generator: draw every step's data first.
  std::vector<torch::Tensor> inputs, upstreams;
  torch::manual_seed(100);
  for (int step = 0; step < kSbnSteps; ++step) {
    inputs.push_back(batch(c.dims, total));
    upstreams.push_back(torch::randn_like(inputs.back()));
  }
  auto errors = run_rank_contexts(world, [&](RankContext& ctx) {
    const int r = ctx.rank;
    const int64_t begin = std::accumulate(c.slices.begin(), c.slices.begin() + r, int64_t{0});
    auto ref = reference_norm(c.dims, options);  // weights 1 and 0 on every rank
    auto sync = sync_norm(c.dims, options, ctx.group);
    for (int step = 0; step < kSbnSteps; ++step) {
      const auto x_all = inputs[step].clone().requires_grad_();
      const auto& upstream = upstreams[step];
      auto y_all = forward_any(ref, x_all);
      (y_all * upstream).sum().backward();

      const auto x = x_all.detach().narrow(0, begin, c.slices[r]).clone().requires_grad_();
      auto y = forward_any(sync, x);
      (y * upstream.narrow(0, begin, c.slices[r])).sum().backward();

      EXPECT_TRUE(close(y, y_all.detach().narrow(0, begin, c.slices[r]), "output")) << step;
      EXPECT_TRUE(close(x.grad(), x_all.grad().narrow(0, begin, c.slices[r]), "input grad"))
          << step;
      auto ref_params = ref->named_parameters(), params = sync->named_parameters();
      for (const char* name : {"weight", "bias"}) {
        auto grad = params[name].grad().clone();
        ctx.group->all_reduce(grad)->wait();  // each rank holds its share
        EXPECT_TRUE(close(grad, ref_params[name].grad(), name)) << step;
      }
      auto ref_buffers = ref->named_buffers(), buffers = sync->named_buffers();
      for (const char* name : {"running_mean", "running_var", "num_batches_tracked"})
        EXPECT_TRUE(close(buffers[name].to(torch::kDouble), ref_buffers[name].to(torch::kDouble),
                          name))
            << step;
      // A step of plain SGD on both, so the weights move apart from 1 and 0.
      torch::NoGradGuard no_grad;
      for (const char* name : {"weight", "bias"}) {
        ref_params[name].sub_(0.1 * ref_params[name].grad());
        params[name].copy_(ref_params[name]);
        ref_params[name].grad().zero_();
        params[name].grad().zero_();
      }
    }
  }, 60s, GroupOptions(), c.backend);
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(
    All, SyncBatchNormEquivalence,
    ::testing::Values(Case{"tcp", 1, {4, 4}, false}, Case{"tcp", 2, {4, 4}, false},
                      Case{"tcp", 3, {2, 2}, false}, Case{"shm", 2, {3, 3, 3}, false},
                      Case{"shm", 1, {2, 2, 2}, true}, Case{"tcp", 2, {5, 1, 2}, false},
                      Case{"shm", 2, {3, 0, 4}, false}, Case{"tcp", 3, {0, 3, 1}, true}),
    [](const auto& info) {
      std::string name = info.param.backend + "_" + std::to_string(info.param.dims) + "d";
      for (auto n : info.param.slices) name += "_" + std::to_string(n);
      return name + (info.param.cumulative ? "_cumulative" : "");
    });

// A small convnet whose norm is `Norm`, the same initial weights for any Norm.
template <typename Norm>
torch::nn::Sequential convnet(Norm norm) {
  static std::mutex seeding;  // ranks are threads sharing torch's generator
  std::lock_guard<std::mutex> lock(seeding);
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3)), norm,
                               torch::nn::ReLU(), torch::nn::Flatten(), torch::nn::Linear(36, 3));
}

TEST(SyncBatchNorm, InsideDdpTrainsLikeBatchNormOnTheWholeBatch) {
  constexpr int kWorld = 3, kBatch = 4;
  auto single = convnet(torch::nn::BatchNorm2d(4));
  torch::optim::SGD single_opt(single->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  std::vector<torch::Tensor> xs, ys;
  for (int s = 0; s < kSbnSteps; ++s) {
    xs.push_back(torch::randn({kWorld * kBatch, 2, 5, 5}));
    ys.push_back(torch::randn({kWorld * kBatch, 3}));
    single_opt.zero_grad();
    torch::mse_loss(single->forward(xs[s]), ys[s]).backward();
    single_opt.step();
  }
  auto errors = run_rank_contexts(kWorld, [&](RankContext& ctx) {
    auto net = convnet(SyncBatchNorm2d(torch::nn::BatchNormOptions(4), ctx.group));
    DistributedDataParallel ddp(net.ptr(), DDPOptions().process_group(ctx.group));
    torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int s = 0; s < kSbnSteps; ++s) {
      opt.zero_grad();
      auto x = xs[s].narrow(0, ctx.rank * kBatch, kBatch);
      auto y = ys[s].narrow(0, ctx.rank * kBatch, kBatch);
      torch::mse_loss(ddp.forward(x), y).backward();
      opt.step();
    }
    auto expected = single->named_parameters();
    for (const auto& p : net->named_parameters())
      EXPECT_TRUE(close(p.value(), expected[p.key()], p.key().c_str())) << "rank " << ctx.rank;
    auto expected_buffers = single->named_buffers();
    for (const auto& b : net->named_buffers())
      EXPECT_TRUE(close(b.value().to(torch::kDouble), expected_buffers[b.key()].to(torch::kDouble),
                        b.key().c_str()))
          << "rank " << ctx.rank;
  }, 120s);
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Four ranks in two pairs, each pair its own subgroup: a pair's statistics
// are its two batches', not the other pair's.
TEST(SyncBatchNorm, OnSubgroupsEachPairSyncsOnlyWithinItself) {
  std::vector<torch::Tensor> pair_batches;
  torch::manual_seed(11);
  for (int p = 0; p < 2; ++p) pair_batches.push_back(batch(2, 6) * (p + 1));
  auto errors = run_rank_contexts(4, [&](RankContext& ctx) {
    const int pair = ctx.rank / 2, half = ctx.rank % 2;
    auto sub = create_process_group("tcp", std::make_shared<PrefixStore>("pair" + std::to_string(pair), ctx.store),
                                    half, 2, GroupOptions().name("pair").timeout(30s));
    SyncBatchNorm2d sync(torch::nn::BatchNormOptions(kChannels), sub);
    torch::nn::BatchNorm2d ref(kChannels);
    const auto& whole = pair_batches[pair];
    auto y = sync->forward(whole.narrow(0, half * 3, 3));
    auto want = ref->forward(whole).narrow(0, half * 3, 3);
    EXPECT_TRUE(close(y, want, "output")) << "rank " << ctx.rank;
    EXPECT_TRUE(close(sync->running_mean, ref->running_mean, "running_mean")) << "rank " << ctx.rank;
  });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(SyncBatchNorm, EvalModeSendsNothingAndUsesRunningStatistics) {
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    if (ctx.rank != 0) return;  // rank 1 never joins: any collective would time out
    SyncBatchNorm2d sync(torch::nn::BatchNormOptions(kChannels), ctx.group);
    torch::nn::BatchNorm2d ref(kChannels);
    sync->running_mean.uniform_();
    sync->running_var.uniform_(0.5, 2);
    ref->running_mean.copy_(sync->running_mean);
    ref->running_var.copy_(sync->running_var);
    sync->eval();
    ref->eval();
    auto x = batch(2, 5);
    EXPECT_TRUE(close(sync->forward(x), ref->forward(x), "eval output"));
  }, 15s);
  testing::expect_no_errors(errors);
}

TEST(SyncBatchNorm, WithoutAProcessGroupItIsBatchNorm) {
  ASSERT_FALSE(is_initialized());
  torch::manual_seed(4);
  SyncBatchNorm3d sync{torch::nn::BatchNormOptions(kChannels)};
  torch::nn::BatchNorm3d ref(kChannels);
  auto x = batch(3, 4);
  EXPECT_TRUE(close(sync->forward(x), ref->forward(x), "output"));
  EXPECT_TRUE(close(sync->running_var, ref->running_var, "running_var"));
}

TEST(SyncBatchNorm, OneValuePerChannelOverTheGroupIsNamedOnEveryRank) {
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    SyncBatchNorm1d sync(torch::nn::BatchNormOptions(kChannels), ctx.group);
    sync->forward(torch::randn({ctx.rank == 0 ? 1 : 0, kChannels}));
  });
  for (const auto& e : errors)
    EXPECT_TRUE(Contains(e, "SyncBatchNorm: expected more than 1 value per channel in training, "
                            "got 1 over the group's 2 ranks"));
}

TEST(SyncBatchNorm, WrongInputShapesAreNamed) {
  SyncBatchNorm2d sync{torch::nn::BatchNormOptions(kChannels)};
  EXPECT_TRUE(Contains(testing::what_thrown<InvalidArgument>([&] { sync->forward(torch::randn({2, 3})); }),
                       "SyncBatchNorm2d: expected 4D input, got 2D input of shape [2, 3]"));
  EXPECT_TRUE(Contains(
      testing::what_thrown<InvalidArgument>([&] { sync->forward(torch::randn({2, 5, 4, 4})); }),
      "SyncBatchNorm2d: expected 3 channels (dim 1), got input of shape [2, 5, 4, 4]"));
}

TEST(ConvertSyncBatchnorm, SequentialKeepsTheBatchNormsTensorsAndMode) {
  auto bn = torch::nn::BatchNorm2d(4);
  auto net = convnet(bn);
  net->eval();
  auto converted = convert_sync_batchnorm(net.ptr());
  auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(converted);
  ASSERT_TRUE(seq);
  ASSERT_EQ(seq->size(), net->size());
  auto sync = seq->ptr<SyncBatchNormImpl<2>>(1);
  ASSERT_TRUE(sync) << "the BatchNorm2d was not swapped";
  EXPECT_TRUE(sync->weight.is_same(bn->weight));
  EXPECT_TRUE(sync->running_var.is_same(bn->running_var));
  EXPECT_TRUE(sync->num_batches_tracked.is_same(bn->num_batches_tracked));
  EXPECT_FALSE(sync->is_training());
  EXPECT_TRUE(seq->ptr(0).get() == net->ptr(0).get()) << "other children are kept";
  EXPECT_EQ(converted->named_parameters().keys(), net->named_parameters().keys());
  auto x = torch::randn({2, 2, 5, 5});
  EXPECT_TRUE(close(seq->forward(x), net->forward(x), "output"));
}

TEST(ConvertSyncBatchnorm, ABatchNormBecomesItsSyncBatchNorm) {
  torch::nn::BatchNorm1d bn(torch::nn::BatchNormOptions(5).affine(false).momentum(0.3));
  auto converted = std::dynamic_pointer_cast<SyncBatchNormImpl<1>>(convert_sync_batchnorm(bn.ptr()));
  ASSERT_TRUE(converted);
  EXPECT_EQ(converted->options.num_features(), 5);
  EXPECT_FALSE(converted->weight.defined());
  EXPECT_EQ(converted->options.momentum(), 0.3);
  EXPECT_TRUE(converted->running_mean.is_same(bn->running_mean));
}

struct Block : torch::nn::Module {
  Block() { bn = register_module("bn", torch::nn::BatchNorm2d(2)); }
  torch::nn::BatchNorm2d bn{nullptr};
};

TEST(ConvertSyncBatchnorm, BatchNormsInCustomModulesAreNamedNotSkipped) {
  auto outer = std::make_shared<torch::nn::Module>();
  outer->register_module("block", std::make_shared<Block>());
  EXPECT_TRUE(Contains(
      testing::what_thrown<InvalidArgument>([&] { convert_sync_batchnorm(outer); }),
      "convert_sync_batchnorm: cannot swap the BatchNorm at block.bn: it is inside a custom "
      "module"));
  auto seq = torch::nn::Sequential(torch::nn::Linear(2, 2), torch::nn::ReLU());
  EXPECT_EQ(convert_sync_batchnorm(seq.ptr()).get(), seq.ptr().get()) << "nothing to swap";
}

TEST(SyncBatchNorm, CloneHasItsOwnTensorsAndPrintsItsName) {
  SyncBatchNorm2d sync{torch::nn::BatchNormOptions(kChannels)};
  sync->running_mean.fill_(2);
  auto copy = std::dynamic_pointer_cast<SyncBatchNormImpl<2>>(sync->clone());
  ASSERT_TRUE(copy);
  EXPECT_FALSE(copy->running_mean.is_same(sync->running_mean));
  EXPECT_TRUE(torch::equal(copy->running_mean, sync->running_mean));
  std::ostringstream text;
  text << *sync;
  EXPECT_EQ(text.str(),
            "dtrain::SyncBatchNorm2d(3, eps=1e-05, momentum=0.1, affine=true, "
            "track_running_stats=true)");
}

}  // namespace
}  // namespace dtrain
