// The nccl backend. Without a GPU (CI, the development machines): creating a
// group fails at once with BackendUnavailable naming CUDA's error. With one
// (a CUDA-enabled libtorch on a GPU machine): every collective and dtype at
// world size 1 (NCCL refuses two ranks on one GPU), the device ordering of
// Work, DDP against single-process training, and a rank that never joins.

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>

#include "dtrain/dtrain.h"
#include "dtrain/store/hash_store.h"
#include "harness/assertions.h"
#include "harness/training.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

bool have_gpu() { return torch::cuda::is_available(); }

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (the nccl tests run on the GPU machine)"

std::shared_ptr<ProcessGroup> nccl_group(int rank = 0, int size = 1,
                                         std::shared_ptr<Store> store = nullptr,
                                         std::chrono::milliseconds timeout = 60s) {
  if (!store) store = std::make_shared<HashStore>();
  return create_process_group("nccl", std::move(store), rank, size,
                              GroupOptions().name("nccl-test").timeout(timeout));
}

TEST(Nccl, WithoutAGpuCreatingAGroupFailsAtOnceNamingCuda) {
  if (have_gpu()) GTEST_SKIP() << "a GPU is present: this checks machines without one";
  const auto start = Clock::now();
  try {
    nccl_group();
    FAIL() << "an nccl group was created without a GPU";
  } catch (const BackendUnavailable& e) {
    EXPECT_TRUE(testing::Contains(e.what(), "nccl: no usable CUDA device: cudaGetDeviceCount: "))
        << e.what();
    EXPECT_TRUE(testing::Contains(e.what(), "cudaError ")) << e.what();
  }
  EXPECT_LT(Clock::now() - start, 5s);
  // The same through init_process_group, as a user calls it; nothing is left
  // initialized.
  EXPECT_THROW(init_process_group(InitOptions()
                                      .backend("nccl")
                                      .store(std::make_shared<HashStore>())
                                      .rank(0)
                                      .world_size(1)),
               BackendUnavailable);
  EXPECT_FALSE(is_initialized());
}

TEST(Nccl, CpuTensorsAreRefusedNamingTheDevice) {
  REQUIRE_GPU();
  auto g = nccl_group();
  auto t = torch::ones({4});
  try {
    g->all_reduce(t)->wait();
    FAIL() << "a CPU tensor was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(testing::Contains(e.what(), "backend 'nccl' does not handle that device type"))
        << e.what();
  }
}

// Exact results of every collective at world size 1 for every dtype: the
// calls go through NCCL (a one-rank communicator still runs its kernels).
class NcclDtypes : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(NcclDtypes, EveryCollectiveIsExactAtWorldSizeOne) {
  REQUIRE_GPU();
  const auto dtype = GetParam();
  auto g = nccl_group();
  const auto cuda = torch::TensorOptions().dtype(dtype).device(torch::kCUDA);
  // Produced by kernels queued just before each call: the work must wait
  // for them on the device.
  auto make = [&] { return (torch::arange(1, 1001, torch::TensorOptions().device(torch::kCUDA)) % 100).to(dtype); };
  const auto expected = make().cpu();
  for (auto op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::PRODUCT, ReduceOp::MIN, ReduceOp::MAX}) {
    auto t = make();
    g->all_reduce(t, op)->wait();
    EXPECT_TRUE(t.cpu().equal(expected)) << "all_reduce " << to_string(op);
    auto r = make();
    g->reduce(r, 0, op)->wait();
    EXPECT_TRUE(r.cpu().equal(expected)) << "reduce " << to_string(op);
  }
  auto b = make();
  g->broadcast(b, 0)->wait();
  EXPECT_TRUE(b.cpu().equal(expected));
  std::vector<at::Tensor> outs = {torch::zeros({1000}, cuda)};
  g->all_gather(outs, make())->wait();
  EXPECT_TRUE(outs[0].cpu().equal(expected));
  auto flat = torch::zeros({1000}, cuda);
  g->all_gather_into_tensor(flat, make())->wait();
  EXPECT_TRUE(flat.cpu().equal(expected));
  auto rs = torch::zeros({1000}, cuda);
  g->reduce_scatter(rs, {make()})->wait();
  EXPECT_TRUE(rs.cpu().equal(expected));
  auto rst = torch::zeros({1000}, cuda);
  g->reduce_scatter_tensor(rst, make())->wait();
  EXPECT_TRUE(rst.cpu().equal(expected));
  std::vector<at::Tensor> gathered = {torch::zeros({1000}, cuda)};
  g->gather(gathered, make(), 0)->wait();
  EXPECT_TRUE(gathered[0].cpu().equal(expected));
  auto sc = torch::zeros({1000}, cuda);
  g->scatter(sc, {make()}, 0)->wait();
  EXPECT_TRUE(sc.cpu().equal(expected));
  std::vector<at::Tensor> a2a = {torch::zeros({1000}, cuda)};
  g->all_to_all(a2a, {make()})->wait();
  EXPECT_TRUE(a2a[0].cpu().equal(expected));
  // Non-contiguous: staged, written back behind the work on the caller's stream.
  auto wide = torch::zeros({1000, 2}, cuda);
  auto column = wide.select(1, 1);
  column.copy_(make());
  g->all_reduce(column)->wait();
  EXPECT_TRUE(wide.select(1, 1).cpu().equal(expected));
  g->barrier()->wait();
}

INSTANTIATE_TEST_SUITE_P(All, NcclDtypes,
                         ::testing::Values(at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                           at::kInt, at::kLong, at::kByte, at::kChar),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

// wait() orders the caller's stream without blocking the host;
// synchronize() blocks until the device is done; the Work is device work.
TEST(Nccl, WaitOrdersTheStreamAndSynchronizeBlocksTheHost) {
  REQUIRE_GPU();
  auto g = nccl_group();
  auto t = torch::full({1 << 22}, 2.0, torch::TensorOptions().device(torch::kCUDA));
  auto work = g->all_reduce(t, ReduceOp::SUM, /*timeout=*/std::nullopt);
  EXPECT_TRUE(work->on_device());
  work->wait();
  t.mul_(3);  // queued behind the all_reduce on the current stream
  EXPECT_EQ(t.sum().item<double>(), 6.0 * (1 << 22));
  work->synchronize(10s);
  EXPECT_TRUE(work->is_completed());
  EXPECT_TRUE(work->is_success());
  // Handles and tensors dropped at once: the group keeps them until the GPU
  // is done with them.
  for (int i = 0; i < 20; ++i) g->all_reduce(torch::ones({1 << 20}, torch::TensorOptions().device(torch::kCUDA)));
  g->barrier()->wait();
}

TEST(Nccl, ARankThatNeverJoinsIsATimeout) {
  REQUIRE_GPU();
  const auto start = Clock::now();
  try {
    nccl_group(0, 2, std::make_shared<HashStore>(), 3s);
    FAIL() << "a 2-rank communicator was created with one rank";
  } catch (const TimeoutError& e) {
    EXPECT_TRUE(testing::Contains(e.what(), "ncclCommInitRankConfig did not complete in time"))
        << e.what();
  }
  EXPECT_LT(Clock::now() - start, 30s);
}

// DDP on one GPU through nccl gives the parameters of plain training.
TEST(Nccl, DdpOnOneGpuMatchesSingleProcessTraining) {
  REQUIRE_GPU();
  using testing::MLPImpl;
  auto reference = testing::make_model<MLPImpl>();
  auto wrapped = testing::make_model<MLPImpl>();
  reference->to(torch::kCUDA);
  wrapped->to(torch::kCUDA);
  auto group = nccl_group();
  DistributedDataParallel ddp(wrapped, DDPOptions().process_group(group).bucket_cap_mb(0.001));
  auto opt_ref = testing::make_sgd(reference->parameters());
  auto opt_ddp = testing::make_sgd(wrapped->parameters());
  for (const auto& batch : testing::make_data<MLPImpl>(16, 10)) {
    auto x = batch.x.to(torch::kCUDA), y = batch.y.to(torch::kCUDA);
    opt_ref.zero_grad();
    torch::mse_loss(reference->forward(x), y).backward();
    opt_ref.step();
    opt_ddp.zero_grad();
    torch::mse_loss(ddp.forward(x), y).backward();
    opt_ddp.step();
  }
  auto a = reference->parameters(), b = wrapped->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::allclose(a[i].cpu(), b[i].cpu(), 1e-5, 1e-6)) << "parameter " << i;
}

}  // namespace
}  // namespace dtrain
