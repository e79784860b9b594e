// Every collective, for every dtype and world sizes 1-4, checked exactly
// against values computed independently in double precision.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cctype>
#include <map>
#include <thread>
#include <tuple>

#include "common/enforce.h"
#include "harness/assertions.h"
#include "harness/exact_values.h"
#include "harness/scoped_env.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

using testing::expect_no_errors;
using testing::run_ranks;
using testing::expect_equal;
using testing::expected_reduction;
using testing::input;
using testing::kOps;
using testing::ops_for;

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                             at::kInt,   at::kLong,   at::kByte, at::kChar};
const std::vector<int64_t> kSizes = {0, 1, 5, 1031, 300000};
class Collectives
    : public ::testing::TestWithParam<std::tuple<std::string, int, at::ScalarType>> {
 protected:
  const std::string& backend() const { return std::get<0>(GetParam()); }
  int world() const { return std::get<1>(GetParam()); }
  at::ScalarType dtype() const { return std::get<2>(GetParam()); }
  std::vector<std::string> run_ranks(int w, const std::function<void(ProcessGroup&)>& body) {
    return testing::run_ranks(w, body, std::chrono::seconds(30), GroupOptions(), backend());
  }
};

TEST_P(Collectives, AllReduceEveryOpAndSize) {
  const int W = world();
  const auto dt = dtype();
  std::map<std::pair<int, int64_t>, at::Tensor> expected;  // {op, n}: once, not per rank
  for (auto op : ops_for(dt))
    for (auto n : kSizes) expected[{static_cast<int>(op), n}] = expected_reduction(W, n, dt, op);
  expect_no_errors(run_ranks(W, [&](ProcessGroup& g) {
    for (auto op : ops_for(dt)) {
      for (auto n : kSizes) {
        auto t = input(g.rank(), n, dt);
        g.all_reduce(t, op)->wait();
        expect_equal(t, expected.at({static_cast<int>(op), n}),
                     detail::cat("all_reduce ", to_string(op), " n=", n, " rank ", g.rank()));
      }
    }
  }));
}

TEST_P(Collectives, AsyncAllReducesCompleteInIssueOrder) {
  const int W = world();
  const auto dt = dtype();
  expect_no_errors(run_ranks(W, [&](ProcessGroup& g) {
    std::vector<at::Tensor> ts;
    std::vector<WorkPtr> works;
    for (int k = 0; k < 8; ++k) {
      ts.push_back(input(g.rank(), 100 + k, dt));
      works.push_back(g.all_reduce(ts.back(), ReduceOp::SUM));
    }
    for (int k = 7; k >= 0; --k) works[k]->wait();  // any wait order
    for (int k = 0; k < 8; ++k) {
      EXPECT_TRUE(works[k]->is_completed());
      EXPECT_TRUE(works[k]->is_success());
      expect_equal(ts[k], expected_reduction(W, 100 + k, dt, ReduceOp::SUM), "async");
    }
  }));
}

TEST_P(Collectives, BroadcastFromEveryRoot) {
  const int W = world();
  const auto dt = dtype();
  expect_no_errors(run_ranks(W, [&](ProcessGroup& g) {
    for (int root = 0; root < W; ++root) {
      for (auto n : kSizes) {
        auto t = input(g.rank(), n, dt);
        g.broadcast(t, root)->wait();
        expect_equal(t, input(root, n, dt), detail::cat("broadcast root ", root, " n=", n));
      }
    }
  }));
}

TEST_P(Collectives, ReduceToEveryRootLeavesOthersUnchanged) {
  const int W = world();
  const auto dt = dtype();
  expect_no_errors(run_ranks(W, [&](ProcessGroup& g) {
    for (int root = 0; root < W; ++root) {
      for (auto op : ops_for(dt)) {
        const int64_t n = 1031;
        auto t = input(g.rank(), n, dt);
        g.reduce(t, root, op)->wait();
        auto want = g.rank() == root ? expected_reduction(W, n, dt, op) : input(g.rank(), n, dt);
        expect_equal(t, want, detail::cat("reduce ", to_string(op), " root ", root));
      }
    }
  }));
}

TEST_P(Collectives, AllGatherGatherScatter) {
  const int W = world();
  const auto dt = dtype();
  expect_no_errors(run_ranks(W, [&](ProcessGroup& g) {
    for (auto n : kSizes) {
      std::vector<at::Tensor> outs;
      for (int r = 0; r < W; ++r) outs.push_back(at::zeros({n}, dt));
      g.all_gather(outs, input(g.rank(), n, dt))->wait();
      for (int r = 0; r < W; ++r)
        expect_equal(outs[r], input(r, n, dt), detail::cat("all_gather n=", n, " from ", r));

      for (int root = 0; root < W; ++root) {
        std::vector<at::Tensor> gathered;
        if (g.rank() == root)
          for (int r = 0; r < W; ++r) gathered.push_back(at::zeros({n}, dt));
        g.gather(gathered, input(g.rank(), n, dt), root)->wait();
        for (int r = 0; r < static_cast<int>(gathered.size()); ++r)
          expect_equal(gathered[r], input(r, n, dt), detail::cat("gather root ", root));

        std::vector<at::Tensor> pieces;
        if (g.rank() == root)
          for (int r = 0; r < W; ++r) pieces.push_back(input(r + 10, n, dt));
        auto out = at::zeros({n}, dt);
        g.scatter(out, pieces, root)->wait();
        expect_equal(out, input(g.rank() + 10, n, dt), detail::cat("scatter root ", root));
      }
    }
  }));
}

TEST_P(Collectives, ReduceScatterEveryOp) {
  const int W = world();
  const auto dt = dtype();
  expect_no_errors(run_ranks(W, [&](ProcessGroup& g) {
    const int64_t n = 257;
    for (auto op : ops_for(dt)) {
      // inputs[j] on rank r is chunk j of rank r's full input.
      auto full = input(g.rank(), n * W, dt);
      auto chunks = full.chunk(W);
      std::vector<at::Tensor> inputs(chunks.begin(), chunks.end());
      auto out = at::zeros({n}, dt);
      g.reduce_scatter(out, inputs, op)->wait();
      auto want = expected_reduction(W, n * W, dt, op).narrow(0, g.rank() * n, n);
      expect_equal(out, want, detail::cat("reduce_scatter ", to_string(op)));
    }
  }));
}

// The in-place pattern (PyTorch's reduce_scatter_tensor with the output a
// chunk of the input): the output is a view of inputs[rank], read by the
// reduction it receives. Sizes span several shm pieces.
TEST_P(Collectives, ReduceScatterOutputAliasingOwnInput) {
  const int W = world();
  const auto dt = dtype();
  expect_no_errors(run_ranks(W, [&](ProcessGroup& g) {
    for (int64_t n : {int64_t(0), int64_t(1), int64_t(257), int64_t(70001)}) {
      for (auto op : ops_for(dt)) {
        auto full = input(g.rank(), n * W, dt);
        std::vector<at::Tensor> inputs;
        for (int j = 0; j < W; ++j) inputs.push_back(full.narrow(0, j * n, n));
        auto out = inputs[g.rank()];
        g.reduce_scatter(out, inputs, op)->wait();
        auto want = expected_reduction(W, n * W, dt, op).narrow(0, g.rank() * n, n);
        expect_equal(out, want,
                     detail::cat("in-place reduce_scatter ", to_string(op), " n=", n, " rank ",
                                 g.rank()));
      }
    }
  }));
}

// The in-place all_gather: the input is a view of outputs[rank].
TEST_P(Collectives, AllGatherInputAliasingOwnOutput) {
  const int W = world();
  const auto dt = dtype();
  expect_no_errors(run_ranks(W, [&](ProcessGroup& g) {
    for (int64_t n : {int64_t(0), int64_t(1), int64_t(257), int64_t(70001)}) {
      auto full = at::zeros({n * W}, dt);
      std::vector<at::Tensor> outputs;
      for (int j = 0; j < W; ++j) outputs.push_back(full.narrow(0, j * n, n));
      outputs[g.rank()].copy_(input(g.rank(), n, dt));
      g.all_gather(outputs, outputs[g.rank()])->wait();
      for (int r = 0; r < W; ++r)
        expect_equal(outputs[r], input(r, n, dt),
                     detail::cat("in-place all_gather n=", n, " from ", r, " on ", g.rank()));
    }
  }));
}

TEST_P(Collectives, AllToAllWithUnevenSizes) {
  const int W = world();
  const auto dt = dtype();
  expect_no_errors(run_ranks(W, [&](ProcessGroup& g) {
    // Rank r sends (r + j) elements to rank j, filled with 10r + j (mod 100).
    std::vector<at::Tensor> inputs, outputs;
    for (int j = 0; j < W; ++j) {
      inputs.push_back(at::full({g.rank() + j}, (10 * g.rank() + j) % 100, dt));
      outputs.push_back(at::zeros({j + g.rank()}, dt));
    }
    g.all_to_all(outputs, inputs)->wait();
    for (int j = 0; j < W; ++j)
      expect_equal(outputs[j], at::full({j + g.rank()}, (10 * j + g.rank()) % 100, dt),
                   detail::cat("all_to_all from ", j));
  }));
}

TEST_P(Collectives, BarrierAndSendRecvRing) {
  const int W = world();
  const auto dt = dtype();
  expect_no_errors(run_ranks(W, [&](ProcessGroup& g) {
    g.barrier()->wait();
    if (W == 1) return;
    const int next = (g.rank() + 1) % W, prev = (g.rank() + W - 1) % W;
    // Both directions posted before any wait: must not deadlock.
    auto incoming = at::zeros({1031}, dt);
    auto recv = g.recv(incoming, prev, /*tag=*/7);
    auto send = g.send(input(g.rank(), 1031, dt), next, /*tag=*/7);
    send->wait();
    recv->wait();
    expect_equal(incoming, input(prev, 1031, dt), "ring recv");
  }));
}

// all_gather_into_tensor and reduce_scatter_tensor against the list forms:
// bitwise equal, for concatenated and stacked layouts, every op; the flat
// input of reduce_scatter_tensor is left as it was.
TEST_P(Collectives, FlatFormsEqualTheListForms) {
  const int W = world();
  const auto dt = dtype();
  expect_no_errors(run_ranks(W, [&](ProcessGroup& g) {
    for (int64_t n : {int64_t{0}, int64_t{5}, int64_t{1031}, int64_t{70000}}) {
      auto piece = input(g.rank(), 2 * n, dt).view({2, n});
      std::vector<at::Tensor> outs;
      for (int r = 0; r < W; ++r) outs.push_back(at::zeros({2, n}, dt));
      g.all_gather(outs, piece)->wait();
      auto concatenated = at::zeros({2 * W, n}, dt), stacked = at::zeros({W, 2, n}, dt);
      g.all_gather_into_tensor(concatenated, piece)->wait();
      g.all_gather_into_tensor(stacked, piece)->wait();
      for (int r = 0; r < W; ++r) {
        expect_equal(concatenated.narrow(0, 2 * r, 2), outs[r], "all_gather_into_tensor cat");
        expect_equal(stacked[r], outs[r], "all_gather_into_tensor stacked");
      }
      for (auto op : ops_for(dt)) {
        auto full = input(g.rank(), W * n, dt);
        const auto before = full.clone();
        auto chunks = full.chunk(W);
        auto listed = at::zeros({n}, dt), flat = at::zeros({n}, dt);
        g.reduce_scatter(listed, std::vector<at::Tensor>(chunks.begin(), chunks.end()), op)->wait();
        g.reduce_scatter_tensor(flat, full, op)->wait();
        expect_equal(flat, listed, "reduce_scatter_tensor " + std::to_string(n));
        expect_equal(full, before, "reduce_scatter_tensor's input");
      }
    }
  }));
}

// PREMUL_SUM through the free functions: the sum of each rank's input times
// 0.5 (exact in every floating dtype for these inputs); other ranks' reduce
// inputs and every reduce_scatter input are left unchanged; integers and
// the group method without a factor are refused.
TEST_P(Collectives, PremulSumScalesEachRanksInput) {
  const int W = world();
  const auto dt = dtype();
  expect_no_errors(run_ranks(W, [&](ProcessGroup& g) {
    auto group = std::shared_ptr<ProcessGroup>(&g, [](ProcessGroup*) {});
    const auto o = ReduceOptions().op(ReduceOp::PREMUL_SUM).premul_factor(0.5).group(group);
    const int64_t n = 1031;
    if (!at::isFloatingType(dt)) {
      auto t = input(g.rank(), n, dt);
      EXPECT_TRUE(testing::Contains(
          testing::what_thrown<InvalidArgument>([&] { all_reduce(t, o); }),
          "all_reduce: ReduceOp::PREMUL_SUM is for floating tensors, got dtype"));
      return;
    }
    const auto want = (expected_reduction(W, n, at::kDouble, ReduceOp::SUM) * 0.5).to(dt);
    auto t = input(g.rank(), n, dt);
    all_reduce(t, o);
    expect_equal(t, want, "all_reduce PREMUL_SUM");
    auto r = input(g.rank(), n, dt);
    reduce(r, W - 1, o);
    expect_equal(r, g.rank() == W - 1 ? want : input(g.rank(), n, dt), "reduce PREMUL_SUM");
    auto full = input(g.rank(), n * W, dt);
    const auto before = full.clone();
    auto out = at::zeros({n}, dt);
    reduce_scatter_tensor(out, full, o);
    const auto want_rs =
        (expected_reduction(W, n * W, at::kDouble, ReduceOp::SUM) * 0.5).to(dt).narrow(0, g.rank() * n, n);
    expect_equal(out, want_rs, "reduce_scatter_tensor PREMUL_SUM");
    expect_equal(full, before, "reduce_scatter_tensor PREMUL_SUM input");
    auto chunks = full.chunk(W);
    auto listed = at::zeros({n}, dt);
    reduce_scatter(listed, std::vector<at::Tensor>(chunks.begin(), chunks.end()), o);
    expect_equal(listed, want_rs, "reduce_scatter PREMUL_SUM");
    EXPECT_TRUE(testing::Contains(
        testing::what_thrown<InvalidArgument>([&] { g.all_reduce(t, ReduceOp::PREMUL_SUM); }),
        "all_reduce: ReduceOp::PREMUL_SUM needs its factor"));
  }));
}

// Rank `src`'s row k for rank `dst`: small values, exact in every dtype.
at::Tensor a2a_rows(int src, int dst, int64_t rows, at::ScalarType dt) {
  auto k = at::arange(rows, at::kDouble).unsqueeze(1).expand({rows, 2});
  return at::fmod(k + src * 7 + dst * 3 + at::arange(2, at::kDouble), 50).to(dt).contiguous();
}

TEST_P(Collectives, AllToAllSingleUnevenAndEqualSplits) {
  const int W = world();
  const auto dt = dtype();
  expect_no_errors(run_ranks(W, [&](ProcessGroup& g) {
    const int r = g.rank();
    auto sends = [](int src, int dst) { return int64_t((src + dst) % 3); };  // 0..2 rows
    std::vector<int64_t> in_splits, out_splits;
    std::vector<at::Tensor> in_parts, want_parts;
    for (int j = 0; j < W; ++j) {
      in_splits.push_back(sends(r, j)), out_splits.push_back(sends(j, r));
      in_parts.push_back(a2a_rows(r, j, sends(r, j), dt));
      want_parts.push_back(a2a_rows(j, r, sends(j, r), dt));
    }
    auto input = at::cat(in_parts), want = at::cat(want_parts);
    auto output = at::full_like(want, 99);
    all_to_all_single(output, input, out_splits, in_splits, CollectiveOptions().group(
        std::shared_ptr<ProcessGroup>(&g, [](ProcessGroup*) {})));
    expect_equal(output, want, "all_to_all_single uneven");
    // Empty split sizes: 2 rows to every rank.
    std::vector<at::Tensor> equal_in, equal_want;
    for (int j = 0; j < W; ++j) {
      equal_in.push_back(a2a_rows(r, j, 2, dt));
      equal_want.push_back(a2a_rows(j, r, 2, dt));
    }
    auto out2 = at::zeros({2 * W, 2}, dt);
    all_to_all_single(out2, at::cat(equal_in), {}, {}, CollectiveOptions().group(
        std::shared_ptr<ProcessGroup>(&g, [](ProcessGroup*) {})));
    expect_equal(out2, at::cat(equal_want), "all_to_all_single equal");
  }));
}

std::string case_name(const ::testing::TestParamInfo<Collectives::ParamType>& info) {
  std::string backend = std::get<0>(info.param);
  for (auto& c : backend) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return detail::cat(backend, "_world", std::get<1>(info.param), "_",
                     c10::toString(std::get<2>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(
    BackendWorldDtype, Collectives,
    ::testing::Combine(::testing::Values("tcp", "shm"), ::testing::Values(1, 2, 3, 4, 5),
                       ::testing::ValuesIn(kDtypes)),
    case_name);

// auto over two stand-in hosts (harness/thread_ranks.h): world 4 is 2 + 2
// ranks (the two-level all_reduce), world 3 is 2 + 1 (flat, rings and TCP
// in one ring).
INSTANTIATE_TEST_SUITE_P(
    AutoOverHosts, Collectives,
    ::testing::Combine(::testing::Values("auto@2"), ::testing::Values(3, 4),
                       ::testing::ValuesIn(kDtypes)),
    case_name);

TEST(CollectivesLayout, NonContiguousTensorsAreStagedAndWrittenBack) {
  expect_no_errors(run_ranks(2, [](ProcessGroup& g) {
    auto base = at::arange(12, at::kFloat).reshape({3, 4}) * (g.rank() + 1);
    auto view = base.t();  // non-contiguous
    ASSERT_FALSE(view.is_contiguous());
    g.all_reduce(view)->wait();
    expect_equal(base, at::arange(12, at::kFloat).reshape({3, 4}) * 3, "transposed all_reduce");
  }));
}

TEST(CollectivesLayout, FlatFormsNameAWrongLayout) {
  expect_no_errors(run_ranks(2, [](ProcessGroup& g) {
    auto in = at::ones({4, 3});
    auto wrong = at::zeros({5, 3});
    auto what = testing::what_thrown<InvalidArgument>(
        [&] { g.all_gather_into_tensor(wrong, in); });
    EXPECT_NE(what.find("all_gather_into_tensor: output has shape [5, 3] for 2 ranks' input of "
                        "shape [4, 3]; expected [8, 3] (concatenated) or [2, 4, 3] (stacked)"),
              std::string::npos)
        << what;
    auto out = at::zeros({3}, at::kDouble);
    what = testing::what_thrown<InvalidArgument>(
        [&] { g.reduce_scatter_tensor(out, at::ones({6}, at::kFloat)); });
    EXPECT_NE(what.find("reduce_scatter_tensor: input has dtype Float but output has Double"),
              std::string::npos)
        << what;
    // A non-contiguous output is staged and written back.
    auto base = at::zeros({3, 4});
    auto t = base.t();  // [4, 3], stacked [2, 2, 3] would need 12: use concatenated [4, 3]
    g.all_gather_into_tensor(t, at::full({2, 3}, float(g.rank())))->wait();
    expect_equal(t.narrow(0, 2, 2), at::ones({2, 3}), "non-contiguous output");
  }));
}

TEST(CollectivesLayout, BitwiseOpsOnFloatsAreRefusedBeforeSending) {
  for (const std::string backend : {"tcp", "shm"}) {
    expect_no_errors(testing::run_ranks(2, [](ProcessGroup& g) {
      auto t = at::ones({4});
      auto what = testing::what_thrown<InvalidArgument>([&] { g.all_reduce(t, ReduceOp::BXOR); });
      EXPECT_TRUE(testing::Contains(what, "all_reduce: ReduceOp::BXOR is for integer tensors, got dtype Float"));
      what = testing::what_thrown<InvalidArgument>(
          [&] { g.reduce_scatter_tensor(at::ones({2}, at::kHalf), at::ones({4}, at::kHalf), ReduceOp::BAND); });
      EXPECT_TRUE(testing::Contains(what, "reduce_scatter_tensor: ReduceOp::BAND is for integer tensors, got dtype Half"));
      // Nothing was sent: the group still works.
      auto n = at::full({3}, g.rank() + 1, at::kInt);
      g.all_reduce(n, ReduceOp::BOR)->wait();
      expect_equal(n, at::full({3}, 3, at::kInt), "BOR after refusals");
    }, std::chrono::seconds(30), GroupOptions(), backend));
  }
}

TEST(CollectivesLayout, AllToAllSingleNamesBadSplits) {
  expect_no_errors(run_ranks(2, [](ProcessGroup& g) {
    auto group = std::shared_ptr<ProcessGroup>(&g, [](ProcessGroup*) {});
    auto o = CollectiveOptions().group(group);
    auto what = testing::what_thrown<InvalidArgument>(
        [&] { all_to_all_single(at::zeros({3}), at::zeros({3}), {}, {}, o); });
    EXPECT_TRUE(testing::Contains(what, "all_to_all_single: output's dim 0 (3) does not divide "
                                        "into 2 equal parts; pass output_split_sizes"));
    what = testing::what_thrown<InvalidArgument>(
        [&] { all_to_all_single(at::zeros({4}), at::zeros({4}), {2, 2}, {1, 2}, o); });
    EXPECT_TRUE(testing::Contains(what, "all_to_all_single: input_split_sizes [1, 2] sum to 3 but "
                                        "input has 4 rows (dim 0)"));
    what = testing::what_thrown<InvalidArgument>(
        [&] { all_to_all_single(at::zeros({4}), at::zeros({4}), {4}, {2, 2}, o); });
    EXPECT_TRUE(testing::Contains(what, "output_split_sizes has 1 entries for a group of 2"));
  }));
}

TEST(CollectivesLayout, MultiDimensionalAllGather) {
  expect_no_errors(run_ranks(3, [](ProcessGroup& g) {
    auto in = at::full({2, 3}, g.rank(), at::kLong);
    std::vector<at::Tensor> outs(3);
    for (auto& o : outs) o = at::empty({2, 3}, at::kLong);
    g.all_gather(outs, in)->wait();
    for (int r = 0; r < 3; ++r) expect_equal(outs[r], at::full({2, 3}, r, at::kLong), "2-D");
  }));
}

}  // namespace
}  // namespace dtrain
