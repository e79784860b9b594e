// Context parallelism (context_parallel.h): ring and Ulysses attention on
// sequence parts over 2 and 4 thread ranks, head-tail and contiguous,
// against attention over the whole sequence in one process, written out
// here (einsum, a mask of -inf, the kv heads indexed per q head): outputs
// and q, k, v gradients; the sharding's parts and positions; bad input
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

using Attention = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const std::shared_ptr<ProcessGroup>&, bool, cp::Sharding);

// Every rank's output and gradient parts (for a non-uniform upstream
// gradient) against the whole sequence's, within 1e-5 relative.
void expect_equals_one_process(Attention attention, int ranks, const Shape& shape, cp::Sharding sharding) {
  SCOPED_TRACE("CP " + std::to_string(ranks) + ", " + std::to_string(shape.heads) + " heads, " +
               std::to_string(shape.kv_heads) + " kv heads" + (shape.causal ? ", causal" : "") +
               (sharding == cp::Sharding::kHeadTail ? ", head-tail" : ", contiguous"));
  torch::manual_seed(3);
  const int64_t batch = 2, seq = 256, dim = 16;
  const auto q = torch::randn({batch, shape.heads, seq, dim}), k = torch::randn({batch, shape.kv_heads, seq, dim}),
             v = torch::randn({batch, shape.kv_heads, seq, dim});
  const auto upstream = torch::randn({batch, shape.heads, seq, dim});
  auto wq = q.clone().requires_grad_(true), wk = k.clone().requires_grad_(true), wv = v.clone().requires_grad_(true);
  const auto want = reference_attention(wq, wk, wv, shape.causal);
  (want * upstream).sum().backward();
  testing::expect_no_errors(testing::run_rank_contexts(ranks, [&](RankContext& ctx) {
    const auto part = [&](const at::Tensor& whole) { return cp::shard_sequence(whole, 2, ctx.group, sharding); };
    auto mq = part(q).clone().requires_grad_(true);
    auto mk = part(k).clone().requires_grad_(true);
    auto mv = part(v).clone().requires_grad_(true);
    const auto out = attention(mq, mk, mv, ctx.group, shape.causal, sharding);
    expect_close(out, part(want.detach()), "the output");
    (out * part(upstream)).sum().backward();
    expect_close(mq.grad(), part(wq.grad()), "q's gradient");
    expect_close(mk.grad(), part(wk.grad()), "k's gradient");
    expect_close(mv.grad(), part(wv.grad()), "v's gradient");
  }, std::chrono::seconds(60)));
}

void expect_equals_one_process_in_every_case(Attention attention) {
  for (int ranks : {2, 4})
    for (auto sharding : {cp::Sharding::kHeadTail, cp::Sharding::kContiguous}) {
      expect_equals_one_process(attention, ranks, {8, 8, true}, sharding);
      expect_equals_one_process(attention, ranks, {8, 8, false}, sharding);
      // Grouped-query attention: 2 kv heads (Ulysses at CP 4: each goes to 2 ranks).
      expect_equals_one_process(attention, ranks, {8, 2, true}, sharding);
    }
}

TEST(RingAttention, EqualsAttentionOverTheWholeSequenceInOneProcess) {
  expect_equals_one_process_in_every_case(&cp::ring_attention);
}

TEST(UlyssesAttention, EqualsAttentionOverTheWholeSequenceInOneProcess) {
  expect_equals_one_process_in_every_case(&cp::ulysses_attention);
}

// Head-tail at CP 4 over 16 positions: rank r holds chunks r and 7 - r of
// 2; its positions are those of its part; unsharding puts every part back.
TEST(ContextParallel, ShardingGivesEachRankAnEarlyAndALateChunkWithTheirPositions) {
  testing::expect_no_errors(testing::run_rank_contexts(4, [](RankContext& ctx) {
    const auto whole = torch::arange(16, torch::kLong).mul(10).reshape({1, 16});
    const auto part = cp::shard_sequence(whole, 1, ctx.group);
    const int64_t r = ctx.rank, late = 7 - r;
    EXPECT_TRUE(torch::equal(part, torch::tensor({2 * r, 2 * r + 1, 2 * late, 2 * late + 1}).mul(10).reshape({1, 4})))
        << part;
    EXPECT_TRUE(torch::equal(cp::sequence_positions(16, ctx.group), part.reshape({4}).div(10, "floor")));
    EXPECT_TRUE(torch::equal(cp::unshard_sequence(part, 1, ctx.group), whole));
    const auto slice = cp::shard_sequence(whole, -1, ctx.group, cp::Sharding::kContiguous);
    EXPECT_TRUE(torch::equal(slice, whole.narrow(1, 4 * r, 4)));
    EXPECT_TRUE(torch::equal(cp::sequence_positions(16, ctx.group, cp::Sharding::kContiguous),
                             torch::arange(4 * r, 4 * r + 4, torch::kLong)));
    EXPECT_TRUE(torch::equal(cp::unshard_sequence(slice, 1, ctx.group, cp::Sharding::kContiguous), whole));
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { cp::shard_sequence(torch::zeros({1, 12}), 1, ctx.group); }),
              "shard_sequence: a sequence of 12 does not split into the 8 equal chunks that head-tail sharding "
              "over 4 ranks needs");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { cp::shard_sequence(whole, 2, ctx.group); }),
              "shard_sequence: no dimension 2 in a tensor of shape [1, 16]");
    const auto q = torch::randn({1, 4, 3, 4});
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { cp::ring_attention(q, q, q, ctx.group); }),
              "ring_attention: a sequence of 12 does not split into the 8 equal chunks that head-tail sharding "
              "over 4 ranks needs");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>(
                  [&] { cp::ring_attention(q, torch::randn({1, 3, 3, 4}), torch::randn({1, 3, 3, 4}), ctx.group); }),
              "ring_attention: q's 4 heads are not a multiple of k and v's 3");
  }));
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
