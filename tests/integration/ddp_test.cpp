// DistributedDataParallel against single-process training: N ranks on batch
// b each must track one process on batch N*b, step after step.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <functional>
#include <iterator>

#include "common/enforce.h"
#include "harness/assertions.h"
#include "harness/models.h"
#include "harness/training.h"
#include "harness/temp_dir.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::Contains;
using testing::RankContext;
using testing::run_rank_contexts;
using testing::Batch;
using testing::make_data;
using testing::make_model;
using testing::make_sgd;

constexpr int kDdpBatch = 4;  // per rank
constexpr int kDdpSteps = 6;
using Configure = std::function<DDPOptions(DDPOptions)>;
const Configure kDefault = [](DDPOptions o) { return o; };

std::vector<torch::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  for (const auto& b : m.buffers()) out.push_back(b.detach().clone());
  return out;
}

void expect_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                  const std::string& what, double rtol = 1e-5, double atol = 1e-6) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    auto x = a[i].to(torch::kDouble), y = b[i].to(torch::kDouble);
    EXPECT_TRUE(torch::allclose(x, y, rtol, atol))
        << what << ": tensor " << i << " differs, max abs diff " << (x - y).abs().max().item<double>();
  }
}

// Single process on the whole batch: parameters and buffers after each step,
// accumulating `micro` micro-batches per step.
template <typename Impl>
std::vector<std::vector<torch::Tensor>> reference_run(const std::vector<Batch>& data, int micro = 1) {
  auto model = make_model<Impl>(0);
  auto opt = make_sgd(model->parameters());
  std::vector<std::vector<torch::Tensor>> after;
  for (size_t s = 0; s + micro <= data.size(); s += micro) {
    opt.zero_grad();
    for (int k = 0; k < micro; ++k) torch::mse_loss(model->forward(data[s + k].x), data[s + k].y).backward();
    opt.step();
    after.push_back(snapshot(*model));
  }
  return after;
}

void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Runs DDP on `world` thread ranks (those in `members` form the DDP group)
// and compares each member with the reference after every step.
template <typename Impl>
void check_equivalence(int world, const Configure& configure, std::vector<int> members = {}) {
  if (members.empty())
    for (int r = 0; r < world; ++r) members.push_back(r);
  const int n = static_cast<int>(members.size());
  auto data = make_data<Impl>(n * kDdpBatch, kDdpSteps);
  auto expected = reference_run<Impl>(data);
  // Different initial weights everywhere: DDP must start all from rank 0's.
  std::vector<std::shared_ptr<Impl>> models;
  for (int r = 0; r < world; ++r) models.push_back(make_model<Impl>(r == members[0] ? 0 : 100 + r));

  expect_no_errors(run_rank_contexts(world, [&](RankContext& ctx) {
    auto it = std::find(members.begin(), members.end(), ctx.rank);
    if (it == members.end()) return;
    const int me = static_cast<int>(it - members.begin());
    auto group = ctx.group;
    if (n != world)
      group = create_process_group("tcp", std::make_shared<PrefixStore>("sub", ctx.store), me, n,
                                   GroupOptions().name("sub").global_ranks(members).timeout(30s));
    DistributedDataParallel ddp(models[ctx.rank], configure(DDPOptions().process_group(group)));
    auto opt = make_sgd(ddp.parameters());
    for (int s = 0; s < kDdpSteps; ++s) {
      opt.zero_grad();
      auto x = data[s].x.narrow(0, me * kDdpBatch, kDdpBatch), y = data[s].y.narrow(0, me * kDdpBatch, kDdpBatch);
      torch::mse_loss(ddp.forward(x), y).backward();
      opt.step();
      expect_close(snapshot(*models[ctx.rank]), expected[s],
                   detail::cat("rank ", ctx.rank, " after step ", s));
    }
  }, 60s));
}

class Equivalence : public ::testing::TestWithParam<std::tuple<int, std::string>> {
 protected:
  int world() const { return std::get<0>(GetParam()); }
  Configure config() const {
    const auto& c = std::get<1>(GetParam());
    if (c == "bucket_view") return [](DDPOptions o) { return o.gradient_as_bucket_view(true); };
    if (c == "tiny_buckets") return [](DDPOptions o) { return o.bucket_cap_mb(0.001); };
    return kDefault;
  }
};

TEST_P(Equivalence, MLP) { check_equivalence<testing::MLPImpl>(world(), config()); }
TEST_P(Equivalence, ConvNet) { check_equivalence<testing::ConvNetImpl>(world(), config()); }
TEST_P(Equivalence, ModelWithBuffers) { check_equivalence<testing::BufferNetImpl>(world(), config()); }

INSTANTIATE_TEST_SUITE_P(WorldByConfig, Equivalence,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values("default", "bucket_view",
                                                              "tiny_buckets")),
                         [](const auto& info) {
                           return detail::cat("world", std::get<0>(info.param), "_",
                                              std::get<1>(info.param));
                         });

TEST(DDP, SubgroupOfTwoOutOfThreeRanks) {
  check_equivalence<testing::MLPImpl>(3, kDefault, {0, 2});
}

TEST(DDP, FindUnusedParametersTrainsLikeOneProcess) {
  check_equivalence<testing::UnusedNetImpl>(
      2, [](DDPOptions o) { return o.find_unused_parameters(true); });
}

TEST(DDP, StaticGraphWithAnUnusedParameter) {
  check_equivalence<testing::UnusedNetImpl>(3, [](DDPOptions o) { return o.static_graph(true); });
}

TEST(DDP, UnusedParameterWithoutTheOptionIsNamedOnEveryRank) {
  std::vector<std::shared_ptr<testing::UnusedNetImpl>> models;
  for (int r = 0; r < 2; ++r) models.push_back(make_model<testing::UnusedNetImpl>(r));
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    DistributedDataParallel ddp(models[ctx.rank], DDPOptions().process_group(ctx.group));
    torch::mse_loss(ddp.forward(torch::ones({2, 10})), torch::zeros({2, 4})).backward();
  }, 30s);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(Contains(errors[r], "2 parameter(s) received no gradient in this backward: "
                                    "'module.unused.weight', 'module.unused.bias'"))
        << "rank " << r;
    EXPECT_TRUE(Contains(errors[r], "DDPOptions().find_unused_parameters(true)")) << "rank " << r;
  }
}

struct WiderImpl : testing::MLPImpl {
  WiderImpl() { fc2 = replace_module("fc2", torch::nn::Linear(32, 5)); }
};

TEST(DDP, ModelThatDiffersByRankFailsConstructionOnEveryRank) {
  auto same = make_model<testing::MLPImpl>(0);
  auto wider = make_model<WiderImpl>(0);
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    std::shared_ptr<testing::MLPImpl> model = ctx.rank == 0 ? same : wider;
    DistributedDataParallel ddp(model, DDPOptions().process_group(ctx.group));
  }, 30s);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(Contains(errors[r], "the model differs across ranks at parameter #2: "
                                    "rank 0 has 'module.fc2.weight' Float [4, 32]; "
                                    "rank 1 has 'module.fc2.weight' Float [5, 32]"))
        << "rank " << r;
  }
}

TEST(DDP, NoSyncAccumulationEqualsTheLargeBatch) {
  const int world = 3, micro = 3;
  auto data = make_data<testing::MLPImpl>(world * kDdpBatch, micro * 2);
  auto expected = reference_run<testing::MLPImpl>(data, micro);
  std::vector<std::shared_ptr<testing::MLPImpl>> models;
  for (int r = 0; r < world; ++r) models.push_back(make_model<testing::MLPImpl>(r == 0 ? 0 : 7 + r));
  expect_no_errors(run_rank_contexts(world, [&](RankContext& ctx) {
    DistributedDataParallel ddp(models[ctx.rank], DDPOptions().process_group(ctx.group));
    auto opt = make_sgd(ddp.parameters());
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      for (int k = 0; k < micro; ++k) {
        const auto& d = data[step * micro + k];
        auto x = d.x.narrow(0, ctx.rank * kDdpBatch, kDdpBatch), y = d.y.narrow(0, ctx.rank * kDdpBatch, kDdpBatch);
        if (k + 1 < micro) {
          auto guard = ddp.no_sync();
          torch::mse_loss(ddp.forward(x), y).backward();
        } else {
          torch::mse_loss(ddp.forward(x), y).backward();
        }
      }
      opt.step();
      expect_close(snapshot(*models[ctx.rank]), expected[step], detail::cat("step ", step));
    }
  }));
}

// Trains `steps` steps with a comm hook made per rank (hooks keep per-process
// state); returns rank 0's parameters.
std::vector<torch::Tensor> train_with_hook(int world, std::function<CommHook()> make_hook,
                                           int steps, std::vector<float>* losses = nullptr) {
  auto data = make_data<testing::MLPImpl>(world * kDdpBatch, 1);
  std::vector<std::shared_ptr<testing::MLPImpl>> models;
  for (int r = 0; r < world; ++r) models.push_back(make_model<testing::MLPImpl>(0));
  std::vector<torch::Tensor> result;
  expect_no_errors(run_rank_contexts(world, [&](RankContext& ctx) {
    DistributedDataParallel ddp(models[ctx.rank], DDPOptions().process_group(ctx.group));
    if (make_hook) ddp.register_comm_hook(make_hook());
    auto opt = make_sgd(ddp.parameters());
    auto x = data[0].x.narrow(0, ctx.rank * kDdpBatch, kDdpBatch), y = data[0].y.narrow(0, ctx.rank * kDdpBatch, kDdpBatch);
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      auto loss = torch::mse_loss(ddp.forward(x), y);
      loss.backward();
      opt.step();
      if (ctx.rank == 0 && losses) losses->push_back(loss.item<float>());
    }
    if (ctx.rank == 0) result = snapshot(*models[0]);
  }));
  return result;
}

TEST(DDP, HalfPrecisionHooksStayWithinTheirTolerance) {
  auto exact = train_with_hook(2, nullptr, 3);
  expect_close(train_with_hook(2, fp16_compress_hook, 3), exact, "fp16 hook", 1e-2, 1e-3);
  expect_close(train_with_hook(2, bf16_compress_hook, 3), exact, "bf16 hook", 5e-2, 5e-3);
}

TEST(DDP, PowerSGDTrainsToTheSameLossRegion) {
  std::vector<float> exact_losses, psgd_losses;
  train_with_hook(2, nullptr, 60, &exact_losses);
  train_with_hook(2, [] {
    return powersgd_hook(PowerSGDOptions().matrix_approximation_rank(2).start_powersgd_iter(5));
  }, 60, &psgd_losses);
  ASSERT_EQ(psgd_losses.size(), 60u);
  // Same start; PowerSGD must get within 2% of the starting loss of where
  // exact averaging ends (here: both near zero, exact ~3e-4, PowerSGD ~2e-3).
  EXPECT_FLOAT_EQ(psgd_losses.front(), exact_losses.front());
  EXPECT_LT(psgd_losses.back(), 0.1f * psgd_losses.front()) << "PowerSGD did not train";
  EXPECT_LT(psgd_losses.back(), exact_losses.back() + 0.02f * exact_losses.front())
      << "PowerSGD final loss " << psgd_losses.back() << " vs exact " << exact_losses.back();
}

TEST(DDP, JoinWithUnevenInputsEndsWithIdenticalParameters) {
  const int world = 3, k = 2;
  auto data = make_data<testing::MLPImpl>(kDdpBatch, k + world);
  std::vector<std::shared_ptr<testing::MLPImpl>> models;
  for (int r = 0; r < world; ++r) models.push_back(make_model<testing::MLPImpl>(r));
  std::vector<std::vector<torch::Tensor>> final_params(world);
  expect_no_errors(run_rank_contexts(world, [&](RankContext& ctx) {
    DistributedDataParallel ddp(models[ctx.rank], DDPOptions().process_group(ctx.group));
    auto opt = make_sgd(ddp.parameters());
    ddp.join([&] {
      for (int s = 0; s < k + ctx.rank; ++s) {  // rank r gets k + r batches
        opt.zero_grad();
        torch::mse_loss(ddp.forward(data[s].x), data[s].y).backward();
        opt.step();
      }
    });
    final_params[ctx.rank] = snapshot(*models[ctx.rank]);
  }));
  for (int r = 1; r < world; ++r)
    for (size_t i = 0; i < final_params[0].size(); ++i)
      EXPECT_TRUE(torch::equal(final_params[r][i], final_params[0][i])) << "rank " << r << " tensor " << i;
}

TEST(DDP, JoinCanThrowOnEarlyTermination) {
  auto data = make_data<testing::MLPImpl>(kDdpBatch, 3);
  std::vector<std::shared_ptr<testing::MLPImpl>> models;
  for (int r = 0; r < 2; ++r) models.push_back(make_model<testing::MLPImpl>(r));
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    DistributedDataParallel ddp(models[ctx.rank], DDPOptions().process_group(ctx.group));
    ddp.join([&] {
      for (int s = 0; s < 1 + 2 * ctx.rank; ++s)
        torch::mse_loss(ddp.forward(data[s].x), data[s].y).backward();
    }, JoinOptions().throw_on_early_termination(true));
  }, 30s);
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(Contains(errors[r], "1 rank(s) ran out of data while others still train")) << r;
}

// An exception in the middle of backward on every rank (a NaN check, an
// out-of-memory that the loop catches and skips): buckets of the later layers
// are already launched when fc1's gradient throws. The step is dropped on
// every rank and training goes on exactly like one process that skipped it.
TEST(DDP, BackwardThatThrowsOnEveryRankIsSkippedAndTrainingGoesOn) {
  const int n = 2, bad = 2;
  auto data = make_data<testing::MLPImpl>(n * kDdpBatch, kDdpSteps);
  auto reference = make_model<testing::MLPImpl>(0);
  auto reference_opt = make_sgd(reference->parameters());
  std::vector<std::vector<torch::Tensor>> expected;
  for (int s = 0; s < kDdpSteps; ++s) {
    if (s != bad) {
      reference_opt.zero_grad();
      torch::mse_loss(reference->forward(data[s].x), data[s].y).backward();
      reference_opt.step();
    }
    expected.push_back(snapshot(*reference));
  }
  std::vector<std::shared_ptr<testing::MLPImpl>> models;
  for (int r = 0; r < n; ++r) models.push_back(make_model<testing::MLPImpl>(r == 0 ? 0 : 100 + r));
  expect_no_errors(run_rank_contexts(n, [&](RankContext& ctx) {
    DistributedDataParallel ddp(models[ctx.rank],
                               DDPOptions().process_group(ctx.group).bucket_cap_mb(0.0001));
    auto opt = make_sgd(ddp.parameters());
    for (int s = 0; s < kDdpSteps; ++s) {
      opt.zero_grad();
      auto x = data[s].x.narrow(0, ctx.rank * kDdpBatch, kDdpBatch);
      auto y = data[s].y.narrow(0, ctx.rank * kDdpBatch, kDdpBatch);
      auto loss = torch::mse_loss(ddp.forward(x), y);
      if (s == bad) {
        auto& w = models[ctx.rank]->fc1->weight;
        const auto hook = w.register_hook([](torch::Tensor g) -> torch::Tensor {
          throw std::runtime_error("gradient check failed");
        });
        EXPECT_THROW(loss.backward(), std::exception);
        w.remove_hook(hook);
        EXPECT_GT(ddp.stats().bucket_bytes.size(), 1u);
        continue;  // the loop skips the step
      }
      loss.backward();
      opt.step();
      expect_close(snapshot(*models[ctx.rank]), expected[s],
                   detail::cat("rank ", ctx.rank, " after step ", s));
    }
  }, 60s));
}

// Only rank 0's backward throws: the others wait for buckets rank 0 never
// launches. Every rank must end with an error within the timeout, not hang.
TEST(DDP, BackwardThatThrowsOnOneRankFailsEveryRankWithinTheTimeout) {
  const int n = 2;
  auto data = make_data<testing::MLPImpl>(n * kDdpBatch, 3);
  std::vector<std::shared_ptr<testing::MLPImpl>> models;
  for (int r = 0; r < n; ++r) models.push_back(make_model<testing::MLPImpl>(0));
  const auto start = std::chrono::steady_clock::now();
  auto errors = run_rank_contexts(n, [&](RankContext& ctx) {
    DistributedDataParallel ddp(models[ctx.rank],
                               DDPOptions().process_group(ctx.group).bucket_cap_mb(0.0001));
    auto opt = make_sgd(ddp.parameters());
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      auto loss = torch::mse_loss(ddp.forward(data[s].x.narrow(0, ctx.rank * kDdpBatch, kDdpBatch)),
                                  data[s].y.narrow(0, ctx.rank * kDdpBatch, kDdpBatch));
      if (s == 1 && ctx.rank == 0) {
        auto& w = models[0]->fc1->weight;
        const auto hook = w.register_hook([](torch::Tensor g) -> torch::Tensor {
          throw std::runtime_error("gradient check failed");
        });
        try {
          loss.backward();
        } catch (const std::exception&) {
        }
        w.remove_hook(hook);
        continue;
      }
      loss.backward();
      opt.step();
    }
  }, 3s);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s);
  // Rank 1 waits in vain for rank 0's remaining buckets; rank 0's next step
  // meets rank 1's pending ones (other sizes) or finds the group broken.
  for (int r = 0; r < n; ++r) {
    EXPECT_NE(errors[r], "") << "rank " << r << " saw no error";
    EXPECT_EQ(errors[r].find("not initialized"), std::string::npos) << errors[r];
  }
}

TEST(DDP, SameRunTwiceIsBitwiseIdentical) {
  auto a = train_with_hook(2, nullptr, 4);
  auto b = train_with_hook(2, nullptr, 4);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "tensor " << i;
}

// One rank: DDP leaves the gradients where autograd put them and issues no
// all_reduce (there is nothing to average), so it trains bitwise like the
// plain model and costs what it does. It once copied every gradient into a
// bucket, all-reduced it alone and copied it back: +15% a step for an MLP
// on a GPU, as PyTorch's DDP still costs there.
TEST(DDP, OneRankTrainsLikeThePlainModelWithoutCollectives) {
  auto errors = run_rank_contexts(1, [&](RankContext& ctx) {
    auto reference = make_model<testing::MLPImpl>(0);
    auto model = make_model<testing::MLPImpl>(0);
    DistributedDataParallel ddp(model, DDPOptions().process_group(ctx.group).find_unused_parameters(true));
    auto opt_ref = make_sgd(reference->parameters());
    auto opt = make_sgd(ddp.parameters());
    for (const auto& batch : make_data<testing::MLPImpl>(8, 4)) {
      opt_ref.zero_grad();
      torch::mse_loss(reference->forward(batch.x), batch.y).backward();
      opt_ref.step();
      opt.zero_grad();
      torch::mse_loss(ddp.forward(batch.x), batch.y).backward();
      opt.step();
    }
    const auto a = reference->parameters(), b = model->parameters();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
    testing::TempDir dir;
    std::ifstream in(dump_flight_recorder(dir.path()));
    const std::string dump{std::istreambuf_iterator<char>(in), {}};
    EXPECT_NE(dump.find("\"format\": \"dtrain-flight-recorder\""), std::string::npos) << dump;
    EXPECT_EQ(dump.find("\"op\": \"all_reduce\""), std::string::npos) << dump;
  });
  testing::expect_no_errors(errors);
}

TEST(DDP, StatsDescribeBucketsAndRebuild) {
  auto model = make_model<testing::MLPImpl>(0);
  int64_t param_bytes = 0;
  for (const auto& p : model->parameters()) param_bytes += p.nbytes();
  std::vector<std::shared_ptr<testing::MLPImpl>> models{model, make_model<testing::MLPImpl>(1)};
  expect_no_errors(run_rank_contexts(2, [&](RankContext& ctx) {
    DistributedDataParallel ddp(models[ctx.rank],
                                DDPOptions().process_group(ctx.group).bucket_cap_mb(0.0005));
    for (int s = 0; s < 2; ++s) {
      torch::mse_loss(ddp.forward(torch::ones({2, 10})), torch::zeros({2, 4})).backward();
      auto st = ddp.stats();
      EXPECT_EQ(st.iteration, s + 1);
      EXPECT_EQ(st.buckets_rebuilt, s == 0);
      EXPECT_GT(st.bucket_bytes.size(), 1u);
      int64_t sum = 0;
      for (auto b : st.bucket_bytes) sum += b;
      EXPECT_EQ(sum, param_bytes);
      EXPECT_GE(st.hidden_fraction, 0.0);
      EXPECT_LE(st.hidden_fraction, 1.0);
      EXPECT_GT(st.communication_ms, 0.0);
    }
  }));
}

TEST(DDP, WrapsModuleHoldersAndPrefixesNames) {
  expect_no_errors(run_rank_contexts(1, [&](RankContext& ctx) {
    torch::nn::Linear linear(3, 2);
    DistributedDataParallel ddp(linear, DDPOptions().process_group(ctx.group));
    auto names = ddp.named_parameters().keys();
    EXPECT_EQ(names, (std::vector<std::string>{"module.weight", "module.bias"}));
    EXPECT_EQ(ddp.forward(torch::ones({4, 3})).sizes(), (std::vector<int64_t>{4, 2}));
  }));
}

}  // namespace
}  // namespace dtrain
