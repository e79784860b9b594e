// Layers that enter a column-parallel region once (enter_column_region) and
// norm gradients summed together (sum_gradients_together), on a block
// shaped as a Llama block: two norms, q, k and v (combined elementwise in
// place of attention) into an output row layer, gate and up into a down
// row layer, residuals. Over 2 thread ranks, with and without sequence
// parallelism, entered once and layer by layer: equal to one process, and
// the flight recorder's collectives counted.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "dtrain/distributed.h"
#include "dtrain/tensor_parallel.h"
#include "harness/assertions.h"
#include "harness/flight_counts.h"
#include "harness/shards.h"
#include "harness/temp_dir.h"
#include "harness/thread_ranks.h"

namespace dtrain {
namespace {

namespace tp = tensor_parallel;
using testing::expect_close;
using testing::RankContext;
using testing::shard;

constexpr int kRanks = 2;
constexpr int64_t kBatch = 2, kSeq = 8, kDim = 8, kInner = 16;

at::Tensor rms(const at::Tensor& x, const at::Tensor& w) {
  return x * torch::rsqrt(x.pow(2).mean(-1, true) + 1e-5) * w;
}

struct Whole {
  at::Tensor n1, n2;
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr}, w1{nullptr}, w3{nullptr}, w2{nullptr};
};

Whole whole_block() {
  torch::manual_seed(31);
  auto linear = [](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
  };
  return {torch::randn({kDim}) * 0.3 + 1, torch::randn({kDim}) * 0.3 + 1, linear(kDim, kInner),
          linear(kDim, kInner), linear(kDim, kInner), linear(kInner, kDim), linear(kDim, kInner),
          linear(kDim, kInner), linear(kInner, kDim)};
}

// Two norm weights as a module, for mark_sequence_parallel (the
// layer-by-layer form).
struct NormsImpl : torch::nn::Module {
  NormsImpl(const at::Tensor& a, const at::Tensor& b)
      : n1(register_parameter("n1", a.clone())), n2(register_parameter("n2", b.clone())) {}
  at::Tensor n1, n2;
};
TORCH_MODULE(Norms);

// One forward and backward of the block over 2 ranks, each rank's results
// held against one process's; the collectives the flight recorder saw.
std::map<std::string, size_t> run_block(bool sequence_parallel, bool entered) {
  SCOPED_TRACE(std::string(sequence_parallel ? "SP" : "no SP") + (entered ? ", entered once" : ", layer by layer"));
  Whole w = whole_block();
  const auto x0 = torch::randn({kBatch, kSeq, kDim});
  // One process.
  std::map<std::string, at::Tensor> want;
  {
    auto x = x0.clone().requires_grad_(true);
    auto n1 = w.n1.clone().requires_grad_(true), n2 = w.n2.clone().requires_grad_(true);
    auto a = rms(x, n1);
    auto h = x + w.o(w.q(a) * w.k(a) + w.v(a));
    auto b = rms(h, n2);
    auto y = h + w.w2(torch::silu(w.w1(b)) * w.w3(b));
    y.pow(2).sum().backward();
    want = {{"y", y.detach()}, {"x", x.grad()}, {"n1", n1.grad()}, {"n2", n2.grad()}};
    for (auto [name, layer] : {std::pair<const char*, torch::nn::Linear>{"q", w.q}, {"k", w.k}, {"v", w.v},
                               {"o", w.o}, {"w1", w.w1}, {"w3", w.w3}, {"w2", w.w2}})
      want[name] = layer->weight.grad();
  }
  const tp::Layout between = sequence_parallel ? tp::Shard(1) : tp::Replicate();
  testing::TempDir dir;
  std::string path;
  testing::expect_no_errors(testing::run_rank_contexts(kRanks, [&](RankContext& ctx) {
    const int r = ctx.rank;
    const auto& g = ctx.group;
    const auto column = tp::ParallelLinearOptions().bias(false).group(g).input_layout(between);
    const auto row = tp::ParallelLinearOptions().bias(false).group(g).output_layout(between);
    tp::ColumnParallelLinear q(w.q, column), k(w.k, column), v(w.v, column), w1(w.w1, column), w3(w.w3, column);
    tp::RowParallelLinear o(w.o, row), w2(w.w2, row);
    Norms norms(w.n1, w.n2);
    if (sequence_parallel && !entered) tp::mark_sequence_parallel(*norms, g);
    auto mine = [&](const at::Tensor& t) { return sequence_parallel ? shard(t, 1, r, kRanks) : t; };
    auto x = mine(x0).clone().requires_grad_(true);
    std::vector<at::Tensor> n{norms->n1, norms->n2};
    if (sequence_parallel && entered) n = tp::sum_gradients_together(n, g);
    // q, k and v (gate and up) from one entry, or each layer entering itself.
    auto three = [&](const at::Tensor& a) {
      if (!entered) return q(a) * k(a) + v(a);
      const auto in = tp::enter_column_region(a, g, between);
      return q->forward_entered(in) * k->forward_entered(in) + v->forward_entered(in);
    };
    auto two = [&](const at::Tensor& b) {
      if (!entered) return torch::silu(w1(b)) * w3(b);
      const auto in = tp::enter_column_region(b, g, between);
      return torch::silu(w1->forward_entered(in)) * w3->forward_entered(in);
    };
    auto h = x + o(three(rms(x, n[0])));
    auto y = h + w2(two(rms(h, n[1])));
    y.pow(2).sum().backward();
    expect_close(y, mine(want.at("y")), "the output");
    expect_close(x.grad(), mine(want.at("x")), "the input's gradient");
    expect_close(norms->n1.grad(), want.at("n1"), "the first norm's gradient");
    expect_close(norms->n2.grad(), want.at("n2"), "the second norm's gradient");
    for (auto [name, layer] : {std::pair<const char*, tp::ColumnParallelLinear>{"q", q}, {"k", k}, {"v", v},
                               {"w1", w1}, {"w3", w3}})
      expect_close(layer->weight.grad(), shard(want.at(name), 0, r, kRanks), std::string(name) + "'s rows of the gradient");
    expect_close(o->weight.grad(), shard(want.at("o"), 1, r, kRanks), "o's columns of the gradient");
    expect_close(w2->weight.grad(), shard(want.at("w2"), 1, r, kRanks), "w2's columns of the gradient");
    g->barrier()->wait();
    if (r == 0) path = dump_flight_recorder(dir.path());
    g->barrier()->wait();
  }));
  return testing::tensor_parallel_collectives(path);
}

// Per rank and block. Under SP, entered once: forward one all-gather per
// entry (q/k/v, gate/up) and one reduce-scatter per row layer; backward
// one reduce-scatter per entry and one all-gather per row layer; one
// all_reduce of both norms' gradients. Layer by layer: an all-gather and a
// reduce-scatter per column layer (5), one all_reduce per norm. Without
// SP: forward one all_reduce per row layer; backward one per entry, or
// one per column layer.
TEST(GatherOnce, ALlamaShapedBlockEqualsOneProcessWithOneCollectivePerEntry) {
  using Ops = std::map<std::string, size_t>;
  const auto per_rank = [](size_t ar, size_t ag, size_t rs) {
    return Ops{{"all_reduce", kRanks * ar}, {"all_gather_into_tensor", kRanks * ag},
               {"reduce_scatter_tensor", kRanks * rs}};
  };
  EXPECT_EQ(run_block(true, true), per_rank(1, 2 + 2, 2 + 2));
  EXPECT_EQ(run_block(true, false), per_rank(2, 5 + 2, 2 + 5));
  EXPECT_EQ(run_block(false, true), per_rank(2 + 2, 0, 0));
  EXPECT_EQ(run_block(false, false), per_rank(2 + 5, 0, 0));
}

// sum_gradients_together against marking each parameter: the same
// gradients in one call, and a parameter the forward did not use left
// without a gradient (as it would be without either).
TEST(GatherOnce, GradientsSummedTogetherEqualEachSummedAloneAndSkipAnUnusedOne) {
  testing::TempDir dir;
  std::string path;
  testing::expect_no_errors(testing::run_rank_contexts(kRanks, [&](RankContext& ctx) {
    const auto& g = ctx.group;
    const double scale = ctx.rank + 1;
    Norms alone(torch::ones({3}), torch::ones({2, 2}));
    tp::mark_sequence_parallel(*alone, g);
    (alone->n1.sum() * scale + (alone->n2 * alone->n2).sum() * scale).backward();
    Norms together(torch::ones({3}), torch::ones({2, 2}));
    auto unused = torch::ones({5}).requires_grad_(true);
    auto n = tp::sum_gradients_together({together->n1, unused, together->n2}, g);
    (n[0].sum() * scale + (n[2] * n[2]).sum() * scale).backward();
    EXPECT_TRUE(at::equal(together->n1.grad(), torch::full({3}, 3.0))) << together->n1.grad();
    EXPECT_TRUE(at::equal(together->n1.grad(), alone->n1.grad()));
    EXPECT_TRUE(at::equal(together->n2.grad(), alone->n2.grad()));
    EXPECT_TRUE(at::equal(together->n2.grad(), torch::full({2, 2}, 6.0))) << together->n2.grad();
    EXPECT_FALSE(unused.grad().defined());
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { tp::sum_gradients_together({together->n1, together->n1}, g); }),
              "sum_gradients_together: parameters 0 and 1 are the same tensor: its gradient would be summed twice");
    EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { tp::mark_sequence_parallel(*together, g); }),
              "mark_sequence_parallel: parameter 'n1' is given to sum_gradients_together: its gradient would be "
              "summed twice");
    g->barrier()->wait();
    if (ctx.rank == 0) path = dump_flight_recorder(dir.path());
    g->barrier()->wait();
  }));
  // Per rank: two alone, one together.
  EXPECT_EQ(testing::tensor_parallel_collectives(path).at("all_reduce"), static_cast<size_t>(kRanks * 3));
}

// The two pairs of layouts the bools of earlier versions refused, with the
// sequence counted from the end (Shard(-2) of [batch, sequence, features]):
// a column layer from sequence shards to the whole output, and a row layer
// from a whole input to sequence shards; each equals the whole Linear.
TEST(GatherOnce, ColumnFromSequenceShardsToAWholeOutputAndRowFromAWholeInputToSequenceShards) {
  torch::manual_seed(41);
  torch::nn::Linear up(kDim, kInner), down(kInner, kDim);
  const auto x0 = torch::randn({kBatch, kSeq, kDim}), m0 = torch::randn({kBatch, kSeq, kInner});
  auto x = x0.clone().requires_grad_(true), m = m0.clone().requires_grad_(true);
  const auto up_out = up(x), down_out = down(m);
  up_out.pow(2).sum().backward();
  down_out.pow(2).sum().backward();
  testing::expect_no_errors(testing::run_rank_contexts(kRanks, [&](RankContext& ctx) {
    const int r = ctx.rank;
    const auto on = tp::ParallelLinearOptions().group(ctx.group);
    tp::ColumnParallelLinear column(up, tp::ParallelLinearOptions(on).input_layout(tp::Shard(-2)).output_layout(tp::Replicate()));
    auto xs = shard(x0, 1, r, kRanks).clone().requires_grad_(true);
    const auto whole = column(xs);
    expect_close(whole, up_out, "the column layer's whole output");
    whole.pow(2).sum().backward();  // the whole loss on every rank: each rank's features' part of it reaches x
    expect_close(xs.grad(), shard(x.grad(), 1, r, kRanks), "its input's gradient, this rank's sequence shard");
    expect_close(column->weight.grad(), shard(up->weight.grad(), 0, r, kRanks), "its rows of the weight's gradient");
    tp::RowParallelLinear row(down, tp::ParallelLinearOptions(on).input_layout(tp::Replicate()).output_layout(tp::Shard(-2)));
    auto mw = m0.clone().requires_grad_(true);
    const auto part = row(mw);
    expect_close(part, shard(down_out, 1, r, kRanks), "the row layer's sequence shard");
    part.pow(2).sum().backward();
    expect_close(mw.grad(), m.grad(), "its whole input's gradient");
    expect_close(row->weight.grad(), shard(down->weight.grad(), 1, r, kRanks), "its columns of the weight's gradient");
    expect_close(row->bias.grad(), down->bias.grad(), "its bias's gradient, summed over the sequence shards");
  }));
}

}  // namespace
}  // namespace dtrain
