// The "auto" backend's routing by device (backends/device_routing): where
// no GPU is, its staged path (CUDA tensors copied to the host, run on the
// CPU group, copied back) is exercised on CPU tensors, which the test
// option stages too. Every collective and point to point must give the
// CPU group's exact results, DDP over it must equal DDP over the CPU
// group bitwise, and a failure of the CPU group must reach the caller.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>

#include "backends/auto/device_routing.h"
#include "dtrain/dtrain.h"
#include "harness/assertions.h"
#include "harness/training.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using testing::RankContext;
using testing::run_rank_contexts;

// CPU tensors staged through host memory too (copied out and back), so
// the staging is exercised where no GPU is; CUDA tensors likewise.
std::shared_ptr<ProcessGroup> staged(RankContext& ctx) {
  auto cpu = ctx.group->backend(c10::DeviceType::CPU);
  using device_routing::StagedBackend;
  return std::make_shared<ProcessGroup>(
      cpu->rank(), cpu->size(), GroupOptions().name("routed").timeout(20s),
      DeviceBackends{{c10::DeviceType::CPU, std::make_shared<StagedBackend>(cpu, c10::kCPU)},
                     {c10::DeviceType::CUDA, std::make_shared<StagedBackend>(cpu, c10::kCUDA)}});
}

TEST(DeviceRouting, StagedCollectivesGiveExactResults) {
  const int world = 3;
  auto errors = run_rank_contexts(world, [&](RankContext& ctx) {
    auto g = staged(ctx);
    const int r = ctx.rank;
    EXPECT_TRUE(g->supports(c10::DeviceType::CUDA));
    EXPECT_TRUE(testing::Contains(g->backend_name(), "CUDA tensors: staged through host memory"));

    auto t = torch::full({5}, r + 1, torch::kInt);
    g->all_reduce(t)->wait();
    EXPECT_TRUE(torch::equal(t, torch::full({5}, 6, torch::kInt)));

    auto b = torch::full({3}, r == 1 ? 7.5 : 0.0);
    g->broadcast(b, 1)->wait();
    EXPECT_TRUE(torch::equal(b, torch::full({3}, 7.5)));

    auto red = torch::full({2}, double(r + 1));
    g->reduce(red, 2, ReduceOp::MAX)->wait();
    EXPECT_TRUE(torch::equal(red, torch::full({2}, r == 2 ? 3.0 : double(r + 1))))
        << "only the root's tensor changes";

    std::vector<torch::Tensor> gathered;
    for (int k = 0; k < world; ++k) gathered.push_back(torch::zeros({2}, torch::kLong));
    g->all_gather(gathered, torch::full({2}, r * 10, torch::kLong))->wait();
    for (int k = 0; k < world; ++k) EXPECT_TRUE(torch::equal(gathered[k], torch::full({2}, k * 10, torch::kLong)));

    std::vector<torch::Tensor> at_root;
    if (r == 0)
      for (int k = 0; k < world; ++k) at_root.push_back(torch::zeros({1}));
    g->gather(at_root, torch::full({1}, double(r)), 0)->wait();
    for (size_t k = 0; k < at_root.size(); ++k) EXPECT_EQ(at_root[k].item<double>(), double(k));

    std::vector<torch::Tensor> pieces;
    if (r == 2)
      for (int k = 0; k < world; ++k) pieces.push_back(torch::full({4}, double(k + 100)));
    auto mine = torch::zeros({4});
    g->scatter(mine, pieces, 2)->wait();
    EXPECT_TRUE(torch::equal(mine, torch::full({4}, double(r + 100))));

    std::vector<torch::Tensor> parts;
    for (int k = 0; k < world; ++k) parts.push_back(torch::full({2}, double(k * (r + 1))));
    auto share = torch::zeros({2});
    g->reduce_scatter(share, parts)->wait();
    EXPECT_TRUE(torch::equal(share, torch::full({2}, double(r * 6))));

    auto flat = torch::zeros({world * 2});
    g->all_gather_into_tensor(flat, torch::full({2}, double(r)))->wait();
    EXPECT_TRUE(torch::equal(flat, torch::tensor({0., 0., 1., 1., 2., 2.})));
    auto slice = torch::zeros({2});
    auto input = torch::arange(world * 2).to(torch::kFloat) * (r + 1);
    g->reduce_scatter_tensor(slice, input)->wait();
    EXPECT_TRUE(torch::equal(slice, torch::arange(2 * r, 2 * r + 2).to(torch::kFloat) * 6));
    EXPECT_TRUE(torch::equal(input, torch::arange(world * 2).to(torch::kFloat) * (r + 1)))
        << "the input is not modified";

    std::vector<torch::Tensor> to_all, from_all;
    for (int k = 0; k < world; ++k) {
      to_all.push_back(torch::full({1}, double(r * 10 + k)));
      from_all.push_back(torch::zeros({1}));
    }
    g->all_to_all(from_all, to_all)->wait();
    for (int k = 0; k < world; ++k) EXPECT_EQ(from_all[k].item<double>(), double(k * 10 + r));

    g->barrier()->wait();
    // Point to point, the receive from any rank naming its sender.
    if (r == 1) g->send(torch::full({3}, 42.0), 0, 5)->wait();
    if (r == 0) {
      auto got = torch::zeros({3});
      auto work = g->recv(got, kAnySource, 5);
      work->wait();
      EXPECT_TRUE(torch::equal(got, torch::full({3}, 42.0)));
      EXPECT_EQ(work->source_rank(), 1);
    }
    g->barrier()->wait();
  }, 60s);
  testing::expect_no_errors(errors);
}

// DDP's buckets staged through host copies: the same parameters, bitwise,
// as DDP on the CPU group itself.
TEST(DeviceRouting, DdpOverTheStagedPathEqualsDdpOnTheCpuGroup) {
  const int world = 2;
  std::vector<std::shared_ptr<testing::MLPImpl>> direct, routed;
  for (int r = 0; r < world; ++r) {
    direct.push_back(testing::make_model<testing::MLPImpl>(0));
    routed.push_back(testing::make_model<testing::MLPImpl>(0));
  }
  std::vector<torch::Tensor> xs, ys;
  for (int s = 0; s < 5 * world; ++s) xs.push_back(torch::randn({4, 10})), ys.push_back(torch::randn({4, 4}));
  auto errors = run_rank_contexts(world, [&](RankContext& ctx) {
    const int r = ctx.rank;
    DistributedDataParallel a(direct[r], DDPOptions().process_group(ctx.group));
    DistributedDataParallel b(routed[r], DDPOptions().process_group(staged(ctx)).bucket_cap_mb(0.001));
    torch::optim::SGD opt_a(a.parameters(), 0.1), opt_b(b.parameters(), 0.1);
    for (int s = 0; s < 5; ++s) {
      opt_a.zero_grad();
      opt_b.zero_grad();
      torch::mse_loss(a.forward(xs[s * world + r]), ys[s * world + r]).backward();
      torch::mse_loss(b.forward(xs[s * world + r]), ys[s * world + r]).backward();
      opt_a.step();
      opt_b.step();
    }
    const auto pa = direct[r]->parameters(), pb = routed[r]->parameters();
    for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "parameter " << i;
  }, 60s);
  testing::expect_no_errors(errors);
}

// A rank that does not take part: the staged all_reduce of the others fails
// with the CPU group's TimeoutError, through the staged work.
TEST(DeviceRouting, AFailureOfTheCpuGroupReachesTheCaller) {
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    auto g = staged(ctx);
    if (ctx.rank == 1) {  // alive, connected, but not taking part
      std::this_thread::sleep_for(1500ms);
      return;
    }
    auto t = torch::ones({4});
    auto work = g->all_reduce(t, ReduceOp::SUM, 300ms);
    try {
      work->wait();
      ADD_FAILURE() << "an all_reduce without its peer succeeded";
    } catch (const TimeoutError& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "all_reduce"));
    }
    EXPECT_TRUE(torch::equal(t, torch::ones({4}))) << "a failed operation wrote its result back";
  }, 30s);
  testing::expect_no_errors(errors);
}

// Two ranks and at most one GPU: the agreement picks the staged path and
// says why (no GPU, or too few for one per rank).
TEST(DeviceRouting, TwoRanksWithoutAGpuEachAreStaged) {
  if (torch::cuda::device_count() >= 2) GTEST_SKIP() << "each rank could have a GPU of its own here";
  EXPECT_EQ(device_routing::nccl_unusable_reason(2),
            torch::cuda::is_available() ? "2 ranks on this machine share 1 GPU(s), and NCCL takes one GPU per rank"
                                        : "no CUDA device is visible to libtorch");
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    auto g = device_routing::route_by_device(ctx.group->backend(c10::DeviceType::CPU), ctx.store,
                                             2, GroupOptions().name("routed"));
    auto cuda = g->backend(c10::DeviceType::CUDA);
    ASSERT_NE(cuda, nullptr);
    EXPECT_EQ(cuda->backend_name(), "staged through host memory");
    auto t = torch::full({2}, 1.0);
    g->all_reduce(t)->wait();  // CPU tensors go straight to the CPU group
    EXPECT_TRUE(torch::equal(t, torch::full({2}, 2.0)));
  });
  testing::expect_no_errors(errors);
}

// auto on a CUDA-enabled libtorch (the routing layer over its CPU group)
// agrees on the CUDA path through the store: the user's first collective is
// #0 everywhere (errors name it so), and nothing was exchanged before it.
// It once took a collective on the CPU group, so every error and dump of a
// GPU build counted one ahead of the user's calls, and DTRAIN_TIMELINE
// opened its file before the rank was known.
TEST(DeviceRouting, AutoWithCudaRoutingTakesNoCollectiveOfItsOwn) {
  auto errors = run_rank_contexts(2, [&](RankContext& ctx) {
    ASSERT_NE(ctx.group->backend(c10::DeviceType::CUDA), nullptr) << ctx.group->backend_name();
    auto t = torch::ones({8});
    try {
      if (ctx.rank == 0) ctx.group->all_reduce(t)->wait();
      else ctx.group->broadcast(t, 0)->wait();
      ADD_FAILURE() << "rank " << ctx.rank << ": a mismatched first collective succeeded";
    } catch (const CollectiveMismatch& e) {
      EXPECT_TRUE(testing::Contains(e.what(), "rank 0: all_reduce #0(Float, 8 elements, SUM)")) << e.what();
      EXPECT_TRUE(testing::Contains(e.what(), "rank 1: broadcast #0(Float, 8 elements, root 0)")) << e.what();
    }
  }, 30s, GroupOptions(), "auto+cuda");
  testing::expect_no_errors(errors);
}

// DDP, FSDP and ZeRO of ranks sharing a GPU through the staged path:
// cuda_process_test.cpp (processes: thread ranks on one GPU share one
// autograd thread, and DDP's hooks would wait there for each other).

// One rank on one GPU: auto sends CUDA tensors to nccl.
TEST(DeviceRouting, OneRankPerGpuGoesThroughNccl) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU is present";
  auto errors = run_rank_contexts(1, [&](RankContext& ctx) {
    EXPECT_TRUE(testing::Contains(ctx.group->backend_name(), "CUDA tensors: nccl")) << ctx.group->backend_name();
    auto t = torch::full({4}, 2.0, torch::Device(torch::kCUDA, 0));
    ctx.group->all_reduce(t)->wait();
    EXPECT_TRUE(torch::equal(t.cpu(), torch::full({4}, 2.0)));
  }, 60s, GroupOptions(), "auto");
  testing::expect_no_errors(errors);
}

}  // namespace
}  // namespace dtrain
