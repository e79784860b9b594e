// Context parallelism (context_parallel.h): Ulysses attention on sequence
// shards over 2 and 4 thread ranks against attention over the whole
// sequence in one process, written out here (einsum, a mask of -inf, the
// kv heads indexed per q head): outputs and q, k, v gradients; bad shapes
// named.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>

#include "dtrain/context_parallel.h"
#include "harness/assertions.h"
#include "harness/shards.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

namespace cp = context_parallel;
using testing::expect_close;
using testing::RankContext;
using testing::shard;

// softmax(q k^T / sqrt(d)) v over the whole sequence, q head h reading kv
// head h / (heads / kv_heads).
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  const int64_t heads = q.size(1), per_kv = heads / k.size(1), s = q.size(2);
  const auto kv_of = torch::arange(heads, torch::kLong).div(per_kv, "floor");
  const auto keys = k.index_select(1, kv_of), values = v.index_select(1, kv_of);
  auto scores = torch::einsum("bhqd,bhkd->bhqk", {q, keys}) / std::sqrt(static_cast<double>(q.size(3)));
  if (causal) {
    const auto pos = torch::arange(s);
    scores = scores.masked_fill(pos.unsqueeze(0) > pos.unsqueeze(1), -std::numeric_limits<double>::infinity());
  }
  return torch::einsum("bhqk,bhkd->bhqd", {scores.softmax(-1), values});
}

struct Shape {
  int64_t heads, kv_heads;
  bool causal;
};

// Every rank's output and gradient shards (for a non-uniform upstream
// gradient) against the whole sequence's, within 1e-5 relative.
void expect_ulysses_equals_one_process(int ranks, const Shape& shape) {
  SCOPED_TRACE("CP " + std::to_string(ranks) + ", " + std::to_string(shape.heads) + " heads, " +
               std::to_string(shape.kv_heads) + " kv heads" + (shape.causal ? ", causal" : ""));
  torch::manual_seed(3);
  const int64_t batch = 2, seq = 256, dim = 16;
  const auto q = torch::randn({batch, shape.heads, seq, dim}), k = torch::randn({batch, shape.kv_heads, seq, dim}),
             v = torch::randn({batch, shape.kv_heads, seq, dim});
  const auto upstream = torch::randn({batch, shape.heads, seq, dim});
  auto wq = q.clone().requires_grad_(true), wk = k.clone().requires_grad_(true), wv = v.clone().requires_grad_(true);
  const auto want = reference_attention(wq, wk, wv, shape.causal);
  (want * upstream).sum().backward();
  testing::expect_no_errors(testing::run_rank_contexts(ranks, [&](RankContext& ctx) {
    auto mq = shard(q, 2, ctx.rank, ranks).clone().requires_grad_(true);
    auto mk = shard(k, 2, ctx.rank, ranks).clone().requires_grad_(true);
    auto mv = shard(v, 2, ctx.rank, ranks).clone().requires_grad_(true);
    const auto out = cp::ulysses_attention(mq, mk, mv, ctx.group, shape.causal);
    expect_close(out, shard(want, 2, ctx.rank, ranks), "the output");
    (out * shard(upstream, 2, ctx.rank, ranks)).sum().backward();
    expect_close(mq.grad(), shard(wq.grad(), 2, ctx.rank, ranks), "q's gradient");
    expect_close(mk.grad(), shard(wk.grad(), 2, ctx.rank, ranks), "k's gradient");
    expect_close(mv.grad(), shard(wv.grad(), 2, ctx.rank, ranks), "v's gradient");
  }, std::chrono::seconds(60)));
}

TEST(UlyssesAttention, EqualsAttentionOverTheWholeSequenceInOneProcess) {
  for (int ranks : {2, 4}) {
    expect_ulysses_equals_one_process(ranks, {8, 8, true});
    expect_ulysses_equals_one_process(ranks, {8, 8, false});
    // Grouped-query attention: 2 kv heads (at CP 4 each goes to 2 ranks).
    expect_ulysses_equals_one_process(ranks, {8, 2, true});
  }
}

TEST(UlyssesAttention, HeadCountsTheGroupDoesNotDivideAndBadShapesAreNamed) {
  testing::expect_no_errors(testing::run_rank_contexts(4, [](RankContext& ctx) {
    const auto kv = torch::randn({1, 4, 8, 4});
    EXPECT_EQ(testing::what_thrown<InvalidArgument>(
                  [&] { cp::ulysses_attention(torch::randn({1, 6, 8, 4}), torch::randn({1, 6, 8, 4}),
                                              torch::randn({1, 6, 8, 4}), ctx.group); }),
              "ulysses_attention: q's 6 heads do not split over the 4 ranks of group 'default'");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>(
                  [&] { cp::ulysses_attention(torch::randn({1, 12, 8, 4}), torch::randn({1, 6, 8, 4}),
                                              torch::randn({1, 6, 8, 4}), ctx.group); }),
              "ulysses_attention: k and v's 6 heads neither split over the 4 ranks of group 'default' nor "
              "divide them (each rank needs whole kv heads)");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>(
                  [&] { cp::ulysses_attention(torch::randn({1, 8, 8, 4}), kv, torch::randn({1, 4, 6, 4}), ctx.group); }),
              "ulysses_attention: k and v must be [1, kv_heads, 8, 4] beside q [1, 8, 8, 4], got [1, 4, 8, 4] and "
              "[1, 4, 6, 4]");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>(
                  [&] { cp::ulysses_attention(torch::randn({1, 8, 8, 4}), torch::randn({1, 3, 8, 4}),
                                              torch::randn({1, 3, 8, 4}), ctx.group); }),
              "ulysses_attention: q's 8 heads are not a multiple of k and v's 3");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { cp::ulysses_attention(torch::randn({8, 4}), kv, kv, ctx.group); }),
              "ulysses_attention: q, k and v must be [batch, heads, seq, head_dim], got [8, 4], [1, 4, 8, 4] and "
              "[1, 4, 8, 4]");
  }));
}

}  // namespace
}  // namespace dtrain
