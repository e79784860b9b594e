// DataParallel against single-module training: after every SGD step the
// original module's gradients and parameters must equal those of one module
// trained on the whole batch (to 1e-5), for CPU replicas; plus uneven
// batches, buffers, input gradients and the error texts. The CUDA test runs
// only where a GPU is present.

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/torch.h>

#include <functional>
#include <mutex>
#include <set>
#include <thread>
#include <string>
#include <vector>

#include "dp/replica_pool.h"
#include "dtrain/data_parallel.h"
#include "dtrain/errors.h"
#include "harness/assertions.h"
#include "harness/models.h"
#include "harness/training.h"

namespace dtrain {
namespace {

using testing::Batch;
using testing::Contains;
using testing::make_model;
using testing::make_sgd;

constexpr int kSteps = 6;

template <typename Impl>
std::vector<Batch> make_data(int64_t rows, int steps = kSteps) {
  return testing::make_data<Impl>(rows, steps);
}

std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters())
    out.push_back(p.grad().defined() ? p.grad().detach().clone() : torch::Tensor());
  return out;
}

std::vector<torch::Tensor> state_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  for (const auto& b : m.buffers()) out.push_back(b.detach().clone());
  return out;
}

void expect_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                  const std::string& what, double tol = 1e-5) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << what << ": tensor " << i;
    if (!a[i].defined()) continue;
    auto x = a[i].to(torch::kDouble), y = b[i].to(torch::kDouble);
    EXPECT_TRUE(torch::allclose(x, y, tol, tol))
        << what << ": tensor " << i << " differs, max abs diff " << (x - y).abs().max().item<double>();
  }
}

struct Trace {
  std::vector<std::vector<torch::Tensor>> grads, states;
};

// Trains `model` with `forward` on `data`: the gradients before and the
// parameters and buffers after every step.
template <typename Forward>
Trace train(torch::nn::Module& model, Forward&& forward, const std::vector<Batch>& data) {
  auto opt = make_sgd(model.parameters());
  Trace trace;
  for (const auto& b : data) {
    opt.zero_grad();
    torch::mse_loss(forward(b.x), b.y).backward();
    trace.grads.push_back(grads_of(model));
    opt.step();
    trace.states.push_back(state_of(model));
  }
  return trace;
}

void expect_same_training(const Trace& dp, const Trace& reference, const std::string& what) {
  ASSERT_EQ(dp.grads.size(), reference.grads.size());
  for (size_t s = 0; s < dp.grads.size(); ++s) {
    expect_close(dp.grads[s], reference.grads[s], what + ", gradients of step " + std::to_string(s));
    expect_close(dp.states[s], reference.states[s], what + ", parameters after step " + std::to_string(s));
  }
}

// One module on the whole batch vs DataParallel with `replicas` CPU replicas.
template <typename Impl>
void check_against_single_module(int replicas, int64_t batch) {
  const auto data = make_data<Impl>(batch);
  auto reference = make_model<Impl>();
  const auto expected = train(*reference, [&](const torch::Tensor& x) { return reference->forward(x); }, data);

  auto net = make_model<Impl>();
  DataParallel dp(net, DataParallelOptions().cpu_replicas(replicas));
  const auto actual = train(*net, [&](const torch::Tensor& x) { return dp.forward(x); }, data);
  expect_same_training(actual, expected,
                       std::to_string(replicas) + " replicas, batch " + std::to_string(batch));
}

TEST(DataParallelTest, MlpTwoReplicasMatchesSingleModule) {
  check_against_single_module<testing::MLPImpl>(2, 12);
}
TEST(DataParallelTest, MlpThreeReplicasMatchesSingleModule) {
  check_against_single_module<testing::MLPImpl>(3, 12);
}
TEST(DataParallelTest, ConvNetTwoReplicasMatchesSingleModule) {
  check_against_single_module<testing::ConvNetImpl>(2, 12);
}
TEST(DataParallelTest, ConvNetThreeReplicasMatchesSingleModule) {
  check_against_single_module<testing::ConvNetImpl>(3, 12);
}
TEST(DataParallelTest, UnevenBatchFiveOverTwoReplicas) {
  check_against_single_module<testing::MLPImpl>(2, 5);
  check_against_single_module<testing::ConvNetImpl>(2, 5);
}
TEST(DataParallelTest, BatchOfOneOverThreeReplicas) {
  check_against_single_module<testing::MLPImpl>(3, 1);
}
TEST(DataParallelTest, BatchSmallerThanReplicasUsesFewerReplicas) {
  check_against_single_module<testing::MLPImpl>(3, 2);
}

// `tied` is fc1's weight, registered a second time: parameters() lists that
// tensor twice (clone() unties the two in the replicas).
struct TiedNetImpl : torch::nn::Cloneable<TiedNetImpl> {
  TiedNetImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(10, 10));
    tied = register_parameter("tied", fc1->weight);
    fc3 = register_module("fc3", torch::nn::Linear(10, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    return fc3(torch::tanh(torch::nn::functional::linear(torch::tanh(fc1(x)), tied)));
  }
  torch::nn::Linear fc1{nullptr}, fc3{nullptr};
  torch::Tensor tied;
};

TEST(DataParallelTest, TiedWeightsMatchSingleModule) {
  auto net = make_model<TiedNetImpl>();
  DataParallel dp(net, DataParallelOptions().cpu_replicas(2));
  ASSERT_TRUE(dp.module()->fc1->weight.is_same(dp.module()->tied));
  check_against_single_module<TiedNetImpl>(3, 12);
}

// BatchNorm in training mode normalizes each chunk with its own statistics,
// as nn.DataParallel does, so the exact reference is one module run on each
// chunk separately (chunks as DataParallel cuts them: sizes differ by at
// most one, larger first), outputs concatenated, one loss and one backward.
// Buffers follow replica 0: the running statistics keep the update from
// chunk 0 only, so the reference restores them after the other chunks. In
// training mode the outputs do not depend on the running statistics, so the
// order of the chunks does not matter.
Trace per_chunk_reference(int replicas, const std::vector<Batch>& data) {
  auto model = make_model<testing::BatchNormNetImpl>();
  return train(*model, [&](const torch::Tensor& x) {
    const int64_t n = std::min<int64_t>(replicas, x.size(0));
    std::vector<torch::Tensor> outs;
    std::vector<torch::Tensor> after_chunk0;
    int64_t offset = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t rows = x.size(0) / n + (i < x.size(0) % n ? 1 : 0);
      outs.push_back(model->forward(x.narrow(0, offset, rows)));
      offset += rows;
      if (i == 0) after_chunk0 = state_of(*model->bn);
    }
    {
      torch::NoGradGuard no_grad;
      auto buffers = model->bn->buffers();
      // set_data, not copy_: chunk 0's graph saved these tensors, and an
      // in-place copy would fail its version check.
      for (size_t b = 0; b < buffers.size(); ++b)
        buffers[b].set_data(after_chunk0[model->bn->parameters().size() + b]);
    }
    return torch::cat(outs, 0);
  }, data);
}

void check_batchnorm_training(int replicas, int64_t batch) {
  const auto data = make_data<testing::BatchNormNetImpl>(batch);
  const auto expected = per_chunk_reference(replicas, data);
  auto net = make_model<testing::BatchNormNetImpl>();
  DataParallel dp(net, DataParallelOptions().cpu_replicas(replicas));
  const auto actual = train(*net, [&](const torch::Tensor& x) { return dp.forward(x); }, data);
  expect_same_training(actual, expected, "BatchNorm, " + std::to_string(replicas) + " replicas");
  // num_batches_tracked counts forwards of replica 0 only: one per step.
  EXPECT_EQ(net->bn->num_batches_tracked.item<int64_t>(), kSteps);
}

TEST(DataParallelTest, BatchNormTwoReplicasMatchesPerChunkReference) { check_batchnorm_training(2, 12); }
TEST(DataParallelTest, BatchNormThreeReplicasMatchesPerChunkReference) { check_batchnorm_training(3, 13); }

// In eval mode BatchNorm uses its running statistics: no batch dependence,
// so DataParallel equals one forward over the whole batch.
TEST(DataParallelTest, BatchNormEvalMatchesSingleModule) {
  const auto data = make_data<testing::BatchNormNetImpl>(12);
  auto reference = make_model<testing::BatchNormNetImpl>();
  auto net = make_model<testing::BatchNormNetImpl>();
  {  // non-trivial running statistics first
    torch::NoGradGuard no_grad;
    reference->forward(data[0].x * 3 + 1);
    net->forward(data[0].x * 3 + 1);
  }
  reference->eval();
  net->eval();
  const auto expected = train(*reference, [&](const torch::Tensor& x) { return reference->forward(x); }, data);
  DataParallel dp(net, DataParallelOptions().cpu_replicas(3));
  const auto actual = train(*net, [&](const torch::Tensor& x) { return dp.forward(x); }, data);
  expect_same_training(actual, expected, "BatchNorm in eval mode");
}

TEST(DataParallelTest, InputGradientMatchesSingleModule) {
  auto reference = make_model<testing::MLPImpl>();
  auto net = make_model<testing::MLPImpl>();
  DataParallel dp(net, DataParallelOptions().cpu_replicas(3));
  const auto x = torch::randn({7, 10});
  auto x1 = x.clone().requires_grad_(true), x2 = x.clone().requires_grad_(true);
  reference->forward(x1).pow(2).sum().backward();
  dp.forward(x2).pow(2).sum().backward();
  expect_close({x2.grad()}, {x1.grad()}, "input gradient");
  expect_close(grads_of(*net), grads_of(*reference), "parameter gradients");
}

// Two forwards through the same DataParallel, one backward over both: the
// second forward must not disturb the first one's graph.
template <typename Impl>
void check_two_forwards_one_backward() {
  const auto data = make_data<Impl>(8, 2);
  auto reference = make_model<Impl>();
  auto net = make_model<Impl>();
  reference->eval();  // BatchNorm: no batch dependence
  net->eval();
  DataParallel dp(net, DataParallelOptions().cpu_replicas(2));
  (torch::mse_loss(reference->forward(data[0].x), data[0].y) +
   torch::mse_loss(reference->forward(data[1].x), data[1].y)).backward();
  (torch::mse_loss(dp.forward(data[0].x), data[0].y) +
   torch::mse_loss(dp.forward(data[1].x), data[1].y)).backward();
  expect_close(grads_of(*net), grads_of(*reference), "gradients of two forwards");
}

TEST(DataParallelTest, TwoForwardsOneBackward) {
  check_two_forwards_one_backward<testing::BatchNormNetImpl>();
  check_two_forwards_one_backward<testing::ConvNetImpl>();
}

TEST(DataParallelTest, GatherAlongAnotherDimWithModuleHolder) {
  torch::manual_seed(0);
  torch::nn::Sequential seq(torch::nn::Linear(10, 8), torch::nn::ReLU(), torch::nn::Linear(8, 4));
  DataParallel dp(seq, DataParallelOptions().cpu_replicas(2).dim(1));
  const auto x = torch::randn({3, 7, 10});
  const auto expected = seq->forward(x);
  const auto y = dp.forward(x);
  EXPECT_EQ(y.sizes(), expected.sizes());
  EXPECT_TRUE(torch::allclose(y, expected, 1e-5, 1e-6));
  y.sum().backward();
  const auto dp_grads = grads_of(*seq);
  seq->zero_grad();
  expected.sum().backward();
  expect_close(dp_grads, grads_of(*seq), "gradients along dim 1");
}

TEST(DataParallelTest, RepeatedRunsAreBitwiseIdentical) {
  const auto data = make_data<testing::ConvNetImpl>(12);
  std::vector<Trace> runs;
  for (int r = 0; r < 2; ++r) {
    auto net = make_model<testing::ConvNetImpl>();
    DataParallel dp(net, DataParallelOptions().cpu_replicas(3));
    runs.push_back(train(*net, [&](const torch::Tensor& x) { return dp.forward(x); }, data));
  }
  for (size_t s = 0; s < runs[0].states.size(); ++s)
    for (size_t i = 0; i < runs[0].states[s].size(); ++i)
      EXPECT_TRUE(torch::equal(runs[0].states[s][i], runs[1].states[s][i])) << "step " << s;
}

TEST(DataParallelTest, NoGradAndFrozenParameters) {
  auto reference = make_model<testing::MLPImpl>();
  auto net = make_model<testing::MLPImpl>();
  reference->fc1->weight.requires_grad_(false);
  net->fc1->weight.requires_grad_(false);
  DataParallel dp(net, DataParallelOptions().cpu_replicas(2));
  const auto x = torch::randn({6, 10});
  {
    torch::NoGradGuard no_grad;
    const auto y = dp.forward(x);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_TRUE(torch::allclose(y, reference->forward(x), 1e-5, 1e-6));
  }
  dp.forward(x).sum().backward();
  reference->forward(x).sum().backward();
  EXPECT_FALSE(net->fc1->weight.grad().defined());
  expect_close(grads_of(*net), grads_of(*reference), "gradients with a frozen parameter");
  // Unfrozen after construction: the replicas follow.
  reference->fc1->weight.requires_grad_(true);
  net->fc1->weight.requires_grad_(true);
  dp.forward(x).sum().backward();
  reference->forward(x).sum().backward();
  expect_close(grads_of(*net), grads_of(*reference), "gradients after unfreezing");
}

TEST(DataParallelTest, ConstructionKeepsTheRandomStream) {
  auto net = make_model<testing::MLPImpl>();
  torch::manual_seed(7);
  const auto expected = torch::randn({4});
  torch::manual_seed(7);
  DataParallel dp(net, DataParallelOptions().cpu_replicas(3));
  EXPECT_TRUE(torch::equal(torch::randn({4}), expected));
  EXPECT_EQ(dp.parameters().size(), net->parameters().size());
  EXPECT_EQ(dp.named_parameters().begin()->key(), "module.fc1.weight");
}

// Records, for every forward, the thread it ran on and that thread's
// intra-op thread count.
struct ThreadProbeImpl : torch::nn::Cloneable<ThreadProbeImpl> {
  struct Seen {
    std::thread::id thread;
    int intra_op_threads;
  };
  static std::mutex mutex;
  static std::vector<Seen> seen;
  ThreadProbeImpl() { reset(); }
  void reset() override { fc = register_module("fc", torch::nn::Linear(10, 4)); }
  torch::Tensor forward(torch::Tensor x) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      seen.push_back({std::this_thread::get_id(), at::get_num_threads()});
    }
    return fc(x);
  }
  torch::nn::Linear fc{nullptr};
};
std::mutex ThreadProbeImpl::mutex;
std::vector<ThreadProbeImpl::Seen> ThreadProbeImpl::seen;

TEST(DataParallelTest, ReplicasRunOnTheirOwnThreadsWithOneIntraOpThread) {
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  auto net = std::make_shared<ThreadProbeImpl>();
  DataParallel dp(net, DataParallelOptions().cpu_replicas(3));
  ThreadProbeImpl::seen.clear();
  dp.forward(torch::randn({6, 10})).sum().backward();
  ASSERT_EQ(ThreadProbeImpl::seen.size(), 3u);
  std::set<std::thread::id> threads;
  for (const auto& s : ThreadProbeImpl::seen) {
    threads.insert(s.thread);
    EXPECT_NE(s.thread, std::this_thread::get_id());
    EXPECT_EQ(s.intra_op_threads, 1);
  }
  EXPECT_EQ(threads.size(), 3u);
  // The caller's setting is untouched, and so are threads started later.
  EXPECT_EQ(at::get_num_threads(), 2);
  int later = 0;
  std::thread([&] { later = at::get_num_threads(); }).join();
  EXPECT_EQ(later, 2);
  at::set_num_threads(before);
}

// create_graph: a gradient penalty differentiates through DataParallel's
// backward.
TEST(DataParallelTest, DoubleBackwardMatchesSingleModule) {
  auto reference = make_model<testing::MLPImpl>();
  auto net = make_model<testing::MLPImpl>();
  DataParallel dp(net, DataParallelOptions().cpu_replicas(2));
  const auto x = torch::randn({6, 10});
  auto penalty = [&](torch::nn::Module& m, const torch::Tensor& y) {
    auto g = torch::autograd::grad({y.pow(2).sum()}, m.parameters(), {}, true, true);
    torch::Tensor total = torch::zeros({});
    for (auto& t : g) total = total + t.pow(2).sum();
    total.backward();
  };
  penalty(*reference, reference->forward(x));
  penalty(*net, dp.forward(x));
  expect_close(grads_of(*net), grads_of(*reference), "gradients of a gradient penalty");
}

// ---- errors ------------------------------------------------------------------

template <typename Fn>
std::string invalid_argument_text(Fn&& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  ADD_FAILURE() << "no InvalidArgument";
  return "";
}

// More replicas than cores and a task for only one of them, many times:
// the idle workers wake at any point, also after run() has returned.
TEST(DataParallelTest, IdleReplicaWorkersWakingLateAreHarmless) {
  dp::ReplicaPool pool(8, /*single_intra_op_thread=*/false);
  std::atomic<int> ran{0};
  const std::vector<std::function<void()>> one = {[&] { ++ran; }};
  for (int i = 0; i < 20000; ++i) pool.run(one);
  EXPECT_EQ(ran.load(), 20000);
}

TEST(DataParallelTest, EmptyBatchIsAnError) {
  auto net = make_model<testing::MLPImpl>();
  DataParallel dp(net, DataParallelOptions().cpu_replicas(2));
  EXPECT_TRUE(Contains(invalid_argument_text([&] { dp.forward(torch::randn({0, 10})); }),
                       "DataParallel::forward: the input has size 0 along dim 0 (shape [0, 10]); "
                       "there is nothing to split across 2 replica(s)"));
}

TEST(DataParallelTest, NonCloneableModuleIsAnError) {
  auto net = make_model<testing::UnusedNetImpl>();  // a plain torch::nn::Module
  const auto text = invalid_argument_text(
      [&] { DataParallel dp(net, DataParallelOptions().cpu_replicas(2)); });
  EXPECT_TRUE(Contains(text, "DataParallel: cannot replicate dtrain::testing::UnusedNetImpl for 2 replicas"));
  EXPECT_TRUE(Contains(text, "clone() has not been implemented for dtrain::testing::UnusedNetImpl. Derive "
                             "dtrain::testing::UnusedNetImpl from "
                             "torch::nn::Cloneable<dtrain::testing::UnusedNetImpl> instead of "
                             "torch::nn::Module"));
  // One replica needs no clone.
  DataParallel single(net, DataParallelOptions().cpu_replicas(1));
  const auto x = torch::randn({3, 10});
  EXPECT_TRUE(torch::equal(single.forward(x), net->forward(x)));
}

TEST(DataParallelTest, BadDeviceIdIsAnError) {
  auto net = make_model<testing::MLPImpl>();
  const auto available = static_cast<int64_t>(torch::cuda::device_count());
  const auto bad = available + 2;
  EXPECT_TRUE(Contains(
      invalid_argument_text([&] { DataParallel dp(net, DataParallelOptions().device_ids({bad})); }),
      "DataParallel: device_ids contains cuda:" + std::to_string(bad) + " but only " +
          std::to_string(available) + " CUDA device(s) are available"));
}

TEST(DataParallelTest, ZeroCpuReplicasIsAnError) {
  auto net = make_model<testing::MLPImpl>();
  EXPECT_TRUE(Contains(
      invalid_argument_text([&] { DataParallel dp(net, DataParallelOptions().cpu_replicas(0)); }),
      "DataParallelOptions::cpu_replicas must be at least 1, got 0"));
}

TEST(DataParallelTest, NoCudaDeviceWithoutCpuReplicasIsAnError) {
  auto net = make_model<testing::MLPImpl>();
  if (torch::cuda::device_count() > 0) {
    net->to(torch::Device(torch::kCUDA, 0));
    DataParallel dp(net);  // every CUDA device
    EXPECT_EQ(dp.devices().size(), torch::cuda::device_count());
    return;
  }
  EXPECT_TRUE(Contains(invalid_argument_text([&] { DataParallel dp(net); }),
                       "DataParallel: no CUDA device is available"));
}

TEST(DataParallelTest, ContradictoryOptionsAreErrors) {
  auto net = make_model<testing::MLPImpl>();
  EXPECT_TRUE(Contains(invalid_argument_text([&] {
                         DataParallel dp(net, DataParallelOptions().cpu_replicas(2).device_ids({0}));
                       }),
                       "cpu_replicas and device_ids are exclusive"));
  DataParallel dp(net, DataParallelOptions().cpu_replicas(2).dim(2));
  EXPECT_TRUE(Contains(invalid_argument_text([&] { dp.forward(torch::randn({4, 10})); }),
                       "dim 2 is out of range for an input of shape [4, 10]"));
}

// ---- CUDA ----------------------------------------------------------------------

// The ConvNet trained on cuda:0 under DataParallel(options) against the
// module alone on the same batches.
void expect_cuda_training_as_single_module(const DataParallelOptions& options, const std::string& what) {
  const torch::Device first(torch::kCUDA, 0);
  std::vector<Batch> on_gpu;
  for (const auto& b : make_data<testing::ConvNetImpl>(12)) on_gpu.push_back({b.x.to(first), b.y.to(first)});
  auto reference = make_model<testing::ConvNetImpl>();
  reference->to(first);
  const auto expected = train(*reference, [&](const torch::Tensor& x) { return reference->forward(x); }, on_gpu);
  auto net = make_model<testing::ConvNetImpl>();
  net->to(first);
  DataParallel dp(net, options);
  const auto actual = train(*net, [&](const torch::Tensor& x) { return dp.forward(x); }, on_gpu);
  expect_same_training(actual, expected, what);
}

TEST(DataParallelTest, CudaReplicasMatchSingleModule) {
  if (!torch::cuda::is_available())
    GTEST_SKIP() << "no GPU is present (torch::cuda::is_available() is false): the CUDA path "
                    "of DataParallel is not exercised on this machine";
  expect_cuda_training_as_single_module(DataParallelOptions(), "one replica per CUDA device");
  // The module must be on device_ids[0].
  auto on_cpu = make_model<testing::ConvNetImpl>();
  EXPECT_TRUE(Contains(invalid_argument_text([&] { DataParallel bad(on_cpu); }),
                       "DataParallel: the module's parameters and buffers must be on cuda:0, where "
                       "replica 0 runs, but 'conv.weight' is on cpu"));
}

// Two replicas on one GPU (device_ids {0, 0}): the same training as the
// module alone, and each replica's forward runs on the caller's current
// stream of that device (a stream from the pool here, not the default), as
// PyTorch's parallel_apply does.
struct StreamProbeImpl : torch::nn::Cloneable<StreamProbeImpl> {
  static std::mutex mutex;
  static std::vector<c10::Stream> seen;
  StreamProbeImpl() { reset(); }
  void reset() override { fc = register_module("fc", torch::nn::Linear(10, 4)); }
  torch::Tensor forward(torch::Tensor x) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      seen.push_back(c10::impl::getDeviceGuardImpl(x.device().type())->getStream(x.device()));
    }
    return fc(x);
  }
  torch::nn::Linear fc{nullptr};
};
std::mutex StreamProbeImpl::mutex;
std::vector<c10::Stream> StreamProbeImpl::seen;

TEST(DataParallelTest, CudaReplicasSharingAGpuRunOnTheCallersStreamAndMatchSingleModule) {
  if (!torch::cuda::is_available())
    GTEST_SKIP() << "no GPU is present (torch::cuda::is_available() is false)";
  const torch::Device first(torch::kCUDA, 0);
  const auto* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  const c10::Stream mine = cuda->getStreamFromGlobalPool(first);
  ASSERT_NE(mine, cuda->getStream(first)) << "the pool gave the current stream";
  c10::StreamGuard on_mine(mine);

  auto probe = std::make_shared<StreamProbeImpl>();
  probe->to(first);
  DataParallel probed(probe, DataParallelOptions().device_ids({0, 0}));
  ASSERT_EQ(probed.devices().size(), 2u);
  StreamProbeImpl::seen.clear();
  probed.forward(torch::randn({6, 10}, first)).sum().backward();
  ASSERT_EQ(StreamProbeImpl::seen.size(), 2u);
  for (const auto& s : StreamProbeImpl::seen) EXPECT_EQ(s, mine) << "a replica ran on " << s;

  expect_cuda_training_as_single_module(DataParallelOptions().device_ids({0, 0}),
                                        "2 CUDA replicas on one GPU");
}

}  // namespace
}  // namespace dtrain
