// Selective activation checkpointing against the same blocks run plainly:
// bitwise the same gradients step after step (dtrain::linear on 2-D, 3-D
// and non-contiguous inputs, with and without a bias, under autocast; the
// tensor-parallel layers with and without sequence parallelism), the kept
// multiplies not run again and the kept row layers' collectives not run
// again (both counted), the mixture-of-experts layer's multiplies kept,
// and bad use named.

#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "dtrain/activation_checkpoint.h"
#include "dtrain/distributed.h"
#include "dtrain/errors.h"
#include "dtrain/expert_parallel.h"
#include "dtrain/tensor_parallel.h"
#include "harness/assertions.h"
#include "harness/cpu_autocast.h"
#include "harness/flight_counts.h"
#include "harness/temp_dir.h"
#include "harness/thread_ranks.h"
#include "harness/tp_block.h"

// A namespace of its own: the file shares a unity unit with others.
namespace dtrain::selective_checkpoint_test {
namespace {

constexpr int64_t kWidth = 8, kInner = 32;

enum class Checkpointing { kNone, kFull, kSelective };

// x + down(gelu(up(norm(x)))) through dtrain::linear.
struct LinearBlockImpl : torch::nn::Module {
  explicit LinearBlockImpl(bool down_bias)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})))),
        up(register_module("up", torch::nn::Linear(kWidth, kInner))),
        down(register_module("down", torch::nn::Linear(torch::nn::LinearOptions(kInner, kWidth).bias(down_bias)))) {}
  at::Tensor forward(const at::Tensor& x) {
    const auto h = torch::gelu(dtrain::linear(norm(x), up->weight, up->bias));
    return x + dtrain::linear(h, down->weight, down->bias);
  }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
TORCH_MODULE(LinearBlock);

// Three blocks from seed 5, each a segment as `mode` says.
struct StackImpl : torch::nn::Module {
  StackImpl(Checkpointing mode, CheckpointPolicy policy, bool down_bias = true) : mode(mode) {
    torch::manual_seed(5);
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("b" + std::to_string(i), LinearBlock(down_bias)));
    if (mode == Checkpointing::kSelective) options.policy(std::move(policy));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& block : blocks) {
      auto run = [block](at::Tensor h) mutable { return block->forward(h); };
      x = mode == Checkpointing::kNone ? run(x) : activation_checkpoint(run, x, options);
    }
    return x;
  }
  Checkpointing mode;
  ActivationCheckpointOptions options;
  std::vector<LinearBlock> blocks;
};
TORCH_MODULE(Stack);

// Every parameter's gradient and the input's, per step, over `steps` Adam
// steps of one model built once; inputs of `shape` (transposed in its first
// two dimensions when `transposed`: not contiguous) from seed 9.
std::vector<std::vector<at::Tensor>> train(Stack model, std::vector<int64_t> shape, bool transposed,
                                           int steps = 30) {
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
  torch::manual_seed(9);
  std::vector<std::vector<at::Tensor>> got;
  for (int step = 0; step < steps; ++step) {
    auto x = torch::randn(shape);
    if (transposed) x = x.transpose(0, 1);
    x.requires_grad_(true);
    const auto target = torch::randn(x.sizes());
    adam.zero_grad();
    torch::mse_loss(model->forward(x), target).backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
    grads.push_back(x.grad().clone());
    got.push_back(grads);
    adam.step();
  }
  return got;
}

void expect_bitwise(const std::vector<std::vector<at::Tensor>>& got,
                    const std::vector<std::vector<at::Tensor>>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t step = 0; step < want.size(); ++step) {
    ASSERT_EQ(got[step].size(), want[step].size());
    for (size_t i = 0; i < want[step].size(); ++i)
      ASSERT_TRUE(at::equal(got[step][i], want[step][i]))
          << "step " << step << ", gradient #" << i << ": off by "
          << (got[step][i] - want[step][i]).abs().max().item<double>();
  }
}

CheckpointPolicy keep_even() {
  return [](const CheckpointedOp& op) { return op.index % 2 == 0; };
}

TEST(SelectiveCheckpoint, GradientsEqualTheBlocksRunPlainlyBitwiseOver30Steps) {
  struct Case {
    const char* name;
    std::vector<int64_t> shape;
    bool transposed, down_bias;
  };
  for (const auto& c : {Case{"3-D input", {2, 6, kWidth}, false, true},
                        Case{"2-D input, down without a bias", {12, kWidth}, false, false},
                        Case{"3-D input, not contiguous", {6, 2, kWidth}, true, true}}) {
    SCOPED_TRACE(c.name);
    const auto plain = train(Stack(Checkpointing::kNone, nullptr, c.down_bias), c.shape, c.transposed);
    for (const auto& [policy_name, policy] :
         {std::pair<const char*, CheckpointPolicy>{"every output kept", keep_matmul_outputs()},
          {"the up layers' kept", keep_even()},
          {"none kept", [](const CheckpointedOp&) { return false; }}}) {
      SCOPED_TRACE(policy_name);
      expect_bitwise(train(Stack(Checkpointing::kSelective, policy, c.down_bias), c.shape, c.transposed), plain);
    }
  }
}

// Counts the matrix multiplies (aten::mm and aten::addmm) this thread runs
// while it lives, the backward's included.
class MatmulCount {
 public:
  MatmulCount()
      : handle_(at::addThreadLocalCallback(at::RecordFunctionCallback(&on_start))) { count() = 0; }
  ~MatmulCount() { at::removeCallback(handle_); }
  MatmulCount(const MatmulCount&) = delete;
  MatmulCount& operator=(const MatmulCount&) = delete;
  static int64_t& count() {
    static thread_local int64_t n = 0;
    return n;
  }

 private:
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    const std::string name = fn.name();
    if (name == "aten::mm" || name == "aten::addmm") ++count();
    return nullptr;
  }
  at::CallbackHandle handle_;
};

// One kept linear, the segment ending in tanh (so its output is kept, not
// the segment's own): the input's, weight's and bias's gradients bitwise the
// plain ones, for inputs of 1 to 4 dimensions (column-major, not
// contiguous) and each of them frozen in turn; the multiply not run again.
TEST(SelectiveCheckpoint, EachGradientOfAKeptLinearIsThePlainOneBitwise) {
  torch::manual_seed(4);
  const std::vector<std::pair<const char*, at::Tensor>> inputs = {
      {"2-D", torch::randn({5, 4})},
      {"2-D, column-major", torch::randn({4, 5}).t()},
      {"1-D", torch::randn({4})},
      {"3-D, not contiguous", torch::randn({3, 2, 4}).transpose(0, 1)},
      {"4-D", torch::randn({2, 3, 2, 4})}};
  const auto w0 = torch::randn({6, 4}), b0 = torch::randn({6});
  struct Needs {
    bool x, w, b, bias;
  };
  for (const auto& [name, x0] : inputs)
    for (const auto& n : {Needs{true, true, true, true}, Needs{true, false, false, true}, Needs{false, true, true, true},
                          Needs{false, false, true, true}, Needs{true, true, false, false},
                          Needs{false, true, false, false}}) {
      SCOPED_TRACE(std::string(name) + ": gradients for the input " + (n.x ? "yes" : "no") + ", the weight " +
                   (n.w ? "yes" : "no") + ", the bias " + (n.bias ? (n.b ? "yes" : "no") : "none"));
      std::vector<at::Tensor> got[2];
      int64_t matmuls[2];
      for (const bool selective : {false, true}) {
        auto x = x0.clone().requires_grad_(n.x);
        auto w = w0.clone().requires_grad_(n.w);
        auto b = n.bias ? b0.clone().requires_grad_(n.b) : at::Tensor();
        auto run = [w, b](at::Tensor h) { return torch::tanh(dtrain::linear(h, w, b)); };
        MatmulCount counted;
        auto y = selective ? activation_checkpoint(run, x, ActivationCheckpointOptions().policy(keep_matmul_outputs()))
                           : run(x);
        y.pow(2).sum().backward();
        matmuls[selective] = MatmulCount::count();
        for (const auto& t : {x, w, b}) got[selective].push_back(t.defined() ? t.grad() : at::Tensor());
      }
      EXPECT_EQ(matmuls[1], matmuls[0]) << "the kept multiply ran again";
      for (size_t i = 0; i < got[0].size(); ++i) {
        ASSERT_EQ(got[1][i].defined(), got[0][i].defined()) << "gradient #" << i;
        if (got[0][i].defined()) EXPECT_TRUE(at::equal(got[1][i], got[0][i])) << "gradient #" << i;
      }
    }
}

// A checkpoint's output may be changed in place by its caller: an output
// that is the segment's own is recomputed, not kept (kept, the change
// would be handed back, and refused).
TEST(SelectiveCheckpoint, TheSegmentsOwnOutputIsRecomputedSoItsCallerMayChangeIt) {
  torch::manual_seed(4);
  const auto w = torch::randn({4, 4}, torch::requires_grad());
  const auto x = torch::randn({3, 4});
  auto y = activation_checkpoint([&](at::Tensor h) { return dtrain::linear(h, w); }, x,
                                 ActivationCheckpointOptions().policy(keep_matmul_outputs()));
  y.mul_(3);
  y.sum().backward();
  const auto got = w.grad().clone();
  w.mutable_grad().reset();
  (dtrain::linear(x, w) * 3).sum().backward();
  EXPECT_TRUE(at::equal(got, w.grad()));
}

// The forward under CPU autocast in bfloat16 (the loss and backward outside
// it): the kept outputs are the bfloat16 ones and the node handing them
// back saves the casts autocast made; every gradient equals the plain run's
// over 3 SGD steps.
TEST(SelectiveCheckpoint, UnderAutocastTheGradientsAreThoseOfTheForwardThatRan) {
  std::vector<std::vector<at::Tensor>> got[2];
  for (const bool selective : {false, true}) {
    Stack model(selective ? Checkpointing::kSelective : Checkpointing::kNone, keep_matmul_outputs());
    torch::optim::SGD sgd(model->parameters(), 0.5);
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(9 + step);
      const auto x = torch::randn({2, 6, kWidth}), y = torch::randn({2, 6, kWidth});
      sgd.zero_grad();
      at::Tensor out;
      {
        testing::CpuAutocast autocast;
        out = model->forward(x);
      }
      torch::mse_loss(out.to(at::kFloat), y).backward();
      std::vector<at::Tensor> grads;
      for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
      got[selective].push_back(grads);
      sgd.step();
    }
  }
  expect_bitwise(got[1], got[0]);
}

int64_t matmuls_in_a_step(Checkpointing mode, CheckpointPolicy policy) {
  Stack model(mode, std::move(policy));
  auto x = torch::randn({2, 6, kWidth}, torch::requires_grad());
  MatmulCount counted;
  model->forward(x).sum().backward();
  return MatmulCount::count();
}

// Per block: 2 multiplies forward, 4 backward (the input's and the
// weight's gradient of each); full checkpointing runs the 2 forward ones
// again, a policy keeping both none, keeping the up layer's one.
TEST(SelectiveCheckpoint, TheKeptMultipliesAreNotRunAgain) {
  constexpr int64_t kBlocks = 3;
  EXPECT_EQ(matmuls_in_a_step(Checkpointing::kNone, nullptr), kBlocks * 6);
  EXPECT_EQ(matmuls_in_a_step(Checkpointing::kFull, nullptr), kBlocks * 8);
  EXPECT_EQ(matmuls_in_a_step(Checkpointing::kSelective, keep_matmul_outputs()), kBlocks * 6);
  EXPECT_EQ(matmuls_in_a_step(Checkpointing::kSelective, keep_even()), kBlocks * 7);
}

TEST(SelectiveCheckpoint, ThePolicyIsAskedAboutEachMultiplyInOrder) {
  std::vector<std::string> asked;
  Stack model(Checkpointing::kSelective, [&](const CheckpointedOp& op) {
    asked.push_back(std::string(op.kind) + " #" + std::to_string(op.index));
    return true;
  });
  model->forward(torch::randn({2, kWidth}, torch::requires_grad())).sum().backward();
  EXPECT_EQ(asked, (std::vector<std::string>{"linear #0", "linear #1", "linear #0", "linear #1", "linear #0",
                                             "linear #1"}));
}

// A retained graph's second backward recomputes what the first handed back
// already: the gradients are the first's again. A plain checkpoint inside a
// selective segment keeps its multiplies to itself.
TEST(SelectiveCheckpoint, ASecondBackwardAndANestedPlainSegmentGiveThePlainGradients) {
  torch::manual_seed(5);
  LinearBlock a(true), b(true);
  const auto x = torch::randn({2, 6, kWidth});
  auto run = [&](at::Tensor h) { return b->forward(a->forward(h)); };
  run(x).sum().backward();
  std::vector<at::Tensor> plain;
  for (auto* m : {&a, &b})
    for (const auto& p : (*m)->parameters()) plain.push_back(p.grad().clone()), p.mutable_grad().reset();
  const auto options = ActivationCheckpointOptions().policy(keep_matmul_outputs());
  auto y = activation_checkpoint(
      [&](at::Tensor h) {
        return b->forward(activation_checkpoint([&](at::Tensor i) { return a->forward(i); }, h));
      },
      x.clone().requires_grad_(true), options);
  y.sum().backward({}, /*retain_graph=*/true);
  y.sum().backward();
  size_t i = 0;
  for (auto* m : {&a, &b})
    for (const auto& p : (*m)->parameters()) {
      EXPECT_TRUE(at::equal(p.grad(), plain[i] * 2)) << "parameter #" << i;
      ++i;
    }
}

TEST(SelectiveCheckpoint, DtrainLinearIsLinear) {
  torch::manual_seed(3);
  const auto w = torch::randn({5, 4}), b = torch::randn({5});
  for (const auto& x : {torch::randn({3, 4}), torch::randn({2, 3, 4}), torch::randn({3, 2, 4}).transpose(0, 1)}) {
    EXPECT_TRUE(at::allclose(dtrain::linear(x, w, b), torch::nn::functional::linear(x, w, b), 1e-6, 1e-6));
    EXPECT_TRUE(at::allclose(dtrain::linear(x, w), torch::nn::functional::linear(x, w), 1e-6, 1e-6));
  }
  EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { dtrain::linear(torch::ones({2, 3}), w); }),
            "linear: an input of shape [2, 3] for a weight of shape [5, 4] (the input's last dimension must be "
            "the weight's second)");
  EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { dtrain::linear(torch::ones({}), w); }),
            "linear: an input of no dimensions (it needs a last one of 4 features)");
  EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { dtrain::linear(torch::ones({2, 4}), b); }),
            "linear: a weight of shape [5] (it must be 2-D: [out, in])");
}

TEST(SelectiveCheckpoint, BadUseIsNamed) {
  torch::manual_seed(3);
  const auto w = torch::randn({4, 4}, torch::requires_grad());
  const auto options = ActivationCheckpointOptions().policy(keep_matmul_outputs());
  auto x = torch::randn({2, 4}, torch::requires_grad());
  // A kept output changed in place in the segment's forward: handing it
  // back would give the changed values.
  auto y = activation_checkpoint([&](at::Tensor h) { return torch::tanh(dtrain::linear(h, w).mul_(2)); }, x, options);
  EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { y.sum().backward(); }),
            "activation_checkpoint: the output of the linear (matrix multiply #0 of the segment) that the policy "
            "kept was changed in place after it was kept; make that operation out of place, or leave this "
            "multiply out of the policy");
  // A segment that runs fewer multiplies the second time.
  int runs = 0;
  y = activation_checkpoint(
      [&](at::Tensor h) {
        h = dtrain::linear(h, w);
        return ++runs == 1 ? dtrain::linear(h, w) : h;
      },
      x, options);
  EXPECT_EQ(testing::what_thrown<InvalidArgument>([&] { y.sum().backward(); }),
            "activation_checkpoint: the segment ran 1 matrix multiply when recomputed but 2 in the forward; it "
            "must compute the same thing twice");
}

// --- Tensor parallelism: two blocks over 2 thread ranks, 3 Adam steps ---

constexpr int kRanks = 2, kSteps = 3, kTpBlocks = 2;

struct TpRun {
  std::vector<std::vector<at::Tensor>> grads[kRanks];  // per step: the parameters' and the input's
  std::map<std::string, size_t> collectives;           // every rank's, all steps
};

TpRun run_tp(bool sequence_parallel, Checkpointing mode) {
  SCOPED_TRACE(sequence_parallel ? "SP" : "no SP");
  TpRun run;
  // Drawn here: the ranks are threads sharing one generator.
  std::vector<testing::BlockInit> inits;
  for (int i = 0; i < kTpBlocks; ++i) inits.push_back(testing::initial_block(kWidth, kInner, 11 + i));
  torch::manual_seed(20);
  std::vector<at::Tensor> xs;
  for (int step = 0; step < kSteps; ++step) xs.push_back(torch::randn({2, 4, kWidth}));
  testing::TempDir dir;
  std::string path;
  testing::expect_no_errors(testing::run_rank_contexts(kRanks, [&](testing::RankContext& ctx) {
    const auto options = testing::block_options(ctx.group, sequence_parallel);
    ActivationCheckpointOptions checkpoint;
    if (mode == Checkpointing::kSelective) checkpoint.policy(keep_matmul_outputs());
    std::vector<testing::TpBlock> blocks;
    std::vector<at::Tensor> params;
    for (int i = 0; i < kTpBlocks; ++i) {
      blocks.emplace_back(inits[i], options, mode != Checkpointing::kNone, checkpoint);
      for (const auto& p : blocks.back()->parameters()) params.push_back(p);
    }
    torch::optim::Adam adam(params, torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < kSteps; ++step) {
      auto x = (sequence_parallel ? testing::shard(xs[step], 1, ctx.rank, kRanks) : xs[step]).clone();
      x.requires_grad_(true);
      adam.zero_grad();
      at::Tensor h = x;
      for (auto& block : blocks) h = block->forward(h);
      h.pow(2).mean().backward();
      std::vector<at::Tensor> grads;
      for (const auto& p : params) grads.push_back(p.grad().clone());
      grads.push_back(x.grad().clone());
      run.grads[ctx.rank].push_back(grads);
      adam.step();
    }
    ctx.group->barrier()->wait();
    if (ctx.rank == 0) path = dump_flight_recorder(dir.path());
    ctx.group->barrier()->wait();
  }));
  run.collectives = testing::tensor_parallel_collectives(path);
  return run;
}

// Per rank, block and step. Under SP: forward the up layer's all-gather and
// the down layer's reduce-scatter, backward the reverse, and an all_reduce
// per norm parameter (2) and for the down layer's bias; full checkpointing runs the forward's two again,
// a policy keeping both outputs only the all-gather (the up layer's weight
// gradient needs its whole input), not the kept reduce-scatter. Without SP:
// the down layer's all_reduce forward and the up layer's backward; full
// checkpointing runs the forward one again, the kept one does not.
TEST(SelectiveCheckpoint, TensorParallelBlocksGiveThePlainGradientsAndRunNoKeptCollectiveTwice) {
  using Ops = std::map<std::string, size_t>;
  const auto times = [](size_t ar, size_t ag, size_t rs) {
    const size_t n = kRanks * kSteps * kTpBlocks;
    return Ops{{"all_reduce", n * ar}, {"all_gather_into_tensor", n * ag}, {"reduce_scatter_tensor", n * rs}};
  };
  for (const bool sp : {true, false}) {
    SCOPED_TRACE(sp ? "SP" : "no SP");
    const auto plain = run_tp(sp, Checkpointing::kNone);
    const auto full = run_tp(sp, Checkpointing::kFull);
    const auto selective = run_tp(sp, Checkpointing::kSelective);
    for (int r = 0; r < kRanks; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      expect_bitwise(full.grads[r], plain.grads[r]);
      expect_bitwise(selective.grads[r], plain.grads[r]);
    }
    EXPECT_EQ(plain.collectives, sp ? times(3, 2, 2) : times(2, 0, 0));
    EXPECT_EQ(full.collectives, sp ? times(3, 3, 3) : times(3, 0, 0));
    EXPECT_EQ(selective.collectives, sp ? times(3, 3, 2) : times(2, 0, 0));
  }
}

// --- Mixture of experts: the router, 8 experts and a shared expert ---

struct MoeRun {
  std::vector<std::vector<at::Tensor>> grads[kRanks];  // per step: the parameters' and the input's
  int64_t matmuls[kRanks] = {};                          // per rank, in its last step
};

// One MoE layer as a segment (or not) as `mode` says, its experts split
// over `ranks` thread ranks (1: all on one), 3 Adam steps.
MoeRun run_moe(int ranks, Checkpointing mode) {
  namespace ep = expert_parallel;
  MoeRun run;
  torch::manual_seed(23);  // drawn here: the ranks are threads sharing one generator
  std::vector<at::Tensor> xs;
  for (int i = 0; i < kSteps * ranks; ++i) xs.push_back(torch::randn({2, 3, kWidth}));
  std::mutex building;
  testing::expect_no_errors(testing::run_rank_contexts(ranks, [&](testing::RankContext& ctx) {
    const auto options = ep::MoEOptions(kWidth, 16, 8).top_k(2).shared_expert_hidden_dim(12).ep_group(ctx.group);
    ep::MoE moe{nullptr};
    {
      std::lock_guard<std::mutex> lock(building);  // every rank draws the same whole experts
      torch::manual_seed(29);
      moe = ep::MoE(options);
    }
    ActivationCheckpointOptions checkpoint;
    if (mode == Checkpointing::kSelective) checkpoint.policy(keep_matmul_outputs());
    torch::optim::Adam adam(moe->parameters(), torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < kSteps; ++step) {
      auto x = xs[step * ranks + ctx.rank].clone().requires_grad_(true);
      adam.zero_grad();
      MatmulCount counted;
      auto layer = [&moe](at::Tensor h) { return moe->forward(h); };
      const at::Tensor y = mode == Checkpointing::kNone ? layer(x) : activation_checkpoint(layer, x, checkpoint);
      (y + x).pow(2).mean().backward();
      run.matmuls[ctx.rank] = MatmulCount::count();
      std::vector<at::Tensor> grads;
      for (const auto& p : moe->parameters()) grads.push_back(p.grad().clone());
      grads.push_back(x.grad().clone());
      run.grads[ctx.rank].push_back(grads);
      adam.step();
    }
  }));
  return run;
}

// The MoE's multiplies (router, experts, shared expert) go through
// dtrain::linear: a policy keeping them all gives bitwise the gradients of
// the layer run plainly, in one process and with the experts over 2 ranks
// (the dispatch's all-to-alls run again in the recomputation), and runs no
// multiply twice; full checkpointing runs each forward one again.
TEST(SelectiveCheckpoint, MixtureOfExpertsKeepsItsMultipliesAndGivesThePlainGradients) {
  for (const int ranks : {1, 2}) {
    SCOPED_TRACE("EP " + std::to_string(ranks));
    const auto plain = run_moe(ranks, Checkpointing::kNone);
    const auto full = run_moe(ranks, Checkpointing::kFull);
    const auto selective = run_moe(ranks, Checkpointing::kSelective);
    for (int r = 0; r < ranks; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      expect_bitwise(full.grads[r], plain.grads[r]);
      expect_bitwise(selective.grads[r], plain.grads[r]);
      EXPECT_EQ(selective.matmuls[r], plain.matmuls[r]);
      // Router, shared expert (3) and 3 per expert of this rank's (8 / ranks).
      EXPECT_EQ(full.matmuls[r], plain.matmuls[r] + 4 + 3 * 8 / ranks);
    }
  }
}

}  // namespace
}  // namespace dtrain::selective_checkpoint_test
