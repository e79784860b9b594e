// tp-equivalence, ep-equivalence and diloco-equivalence: tensor
// parallelism (with sequence parallelism and activation checkpointing),
// expert parallelism and DiLoCo as processes, on the CPU or on CUDA
// tensors, against one process training the same model on the whole batch
// (rank_worker.cpp lists the modes).

#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "dtrain/ddp.h"
#include "dtrain/distributed.h"
#include "dtrain/expert_parallel.h"
#include "dtrain/local_sgd.h"
#include "harness/tp_block.h"
#include "integration/rank_worker.h"

namespace {

namespace ep = dtrain::expert_parallel;
namespace tp = dtrain::tensor_parallel;

// Within 1e-5 of `want` relative to its largest magnitude (floored).
bool near_whole(const at::Tensor& got, const at::Tensor& want) {
  if (got.sizes() != want.sizes()) return false;
  const auto g = got.detach().cpu().to(torch::kDouble), w = want.detach().cpu().to(torch::kDouble);
  const double scale = std::max(w.abs().max().item<double>(), 1e-3);
  return (g - w).abs().max().item<double>() / scale <= 1e-5;
}

void say_matches(const std::string& what, torch::Device device) {
  std::cout << "rank " << dtrain::get_rank() << " " << what << " matches single-process training on "
            << dtrain::default_group()->backend_name() << " with tensors on " << device << std::endl;
}

}  // namespace

// The pre-norm MLP block (harness/tp_block.h) over every rank: up
// column-parallel, down row-parallel, the norm under sequence parallelism,
// the block one activation-checkpointed segment; 5 Adam steps on this
// rank's part of the sequence against one process on all of it.
int tp_equivalence(const std::string& backend, torch::Device device) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  auto init = dtrain::testing::initial_block(8, 16);
  init.norm->to(device);
  init.up->to(device);
  init.down->to(device);
  torch::manual_seed(5);
  std::vector<at::Tensor> xs, ys;
  for (int step = 0; step < 5; ++step) {
    xs.push_back(torch::randn({2, 4 * world, 8}).to(device));
    ys.push_back(torch::randn({2, 4 * world, 8}).to(device));
  }
  const auto want = dtrain::testing::one_process(init, xs, ys, dtrain::testing::kAdam);
  dtrain::testing::TpBlock block(
      init, dtrain::testing::block_options(dtrain::default_group(), true), true);
  auto adam = dtrain::testing::kAdam(block->parameters());
  for (int step = 0; step < 5; ++step) {
    adam->zero_grad();
    auto x = xs[step].narrow(1, 4 * rank, 4).clone().requires_grad_(true);
    auto out = block(x);
    ((out - ys[step].narrow(1, 4 * rank, 4)).pow(2).sum() / xs[step].numel()).backward();
    if (step == 0) {
      if (!near_whole(out, want.output.narrow(1, 4 * rank, 4))) return fail("the block's output differs");
      if (!near_whole(x.grad(), want.input_grad.narrow(1, 4 * rank, 4))) return fail("the input's gradient differs");
      for (const auto& p : block->named_parameters())
        if (!near_whole(p.value().grad(), dtrain::testing::block_shard(want.grads, p.key(), rank, world)))
          return fail(p.key() + "'s gradient differs");
    }
    adam->step();
  }
  for (const auto& p : block->named_parameters())
    if (!near_whole(p.value(), dtrain::testing::block_shard(want.after, p.key(), rank, world)))
      return fail(p.key() + " differs after 5 Adam steps");
  say_matches("tp+sp+ac", device);
  dtrain::destroy_process_group();
  return 0;
}

// An MoE (8 experts, top-2, a shared expert, sigmoid routing with the
// bias update; experts 6 and 7 never chosen) with its experts split over
// every rank and the rest under DDP: 5 Adam steps on this rank's two
// sequences against one process on every rank's.
int ep_equivalence(const std::string& backend, torch::Device device) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  auto options = ep::MoEOptions(8, 16, 8).top_k(2).shared_expert_hidden_dim(12)
                           .score_func(ep::ScoreFunction::kSigmoid).route_norm(true).load_balance_coeff(1e-3);
  auto build = [&](const ep::MoEOptions& o) {
    torch::manual_seed(11);
    ep::MoE m(o);
    torch::NoGradGuard no_grad;
    m->expert_bias[6] = -100.0;
    m->expert_bias[7] = -100.0;
    m->to(device);
    return m;
  };
  ep::MoE single = build(options);
  ep::MoE moe = build(ep::MoEOptions(options).ep_group(dtrain::default_group()));
  dtrain::DistributedDataParallel ddp(
      moe.ptr(), dtrain::DDPOptions().params_and_buffers_to_ignore(ep::ignored_by_data_parallel(*moe)));
  torch::optim::Adam adam(moe->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam single_adam(single->parameters(), torch::optim::AdamOptions(1e-2));
  torch::manual_seed(1000);
  for (int step = 0; step < 5; ++step) {
    const auto x = torch::randn({2 * world, 3, 8}).to(device), y = torch::randn({2 * world, 3, 8}).to(device);
    single_adam.zero_grad();
    (single(x) + x - y).pow(2).mean().backward();
    adam.zero_grad();
    const auto mx = x.narrow(0, 2 * rank, 2), my = y.narrow(0, 2 * rank, 2);
    (ddp.forward(mx) + mx - my).pow(2).mean().backward();
    if (step == 0) {
      auto want = single->named_parameters();
      for (const auto& p : moe->named_parameters()) {
        auto whole = want[p.key()].grad();
        if (p.key().rfind("experts.", 0) == 0)
          whole = whole.narrow(0, moe->experts->first_expert(), moe->experts->local_experts());
        if (!near_whole(p.value().grad(), whole)) return fail(p.key() + "'s gradient differs");
      }
    }
    single_adam.step();
    adam.step();
    single->update_expert_bias();
    moe->update_expert_bias(dtrain::default_group());
  }
  auto want = single->named_parameters();
  for (const auto& p : moe->named_parameters()) {
    auto whole = want[p.key()];
    if (p.key().rfind("experts.", 0) == 0)
      whole = whole.narrow(0, moe->experts->first_expert(), moe->experts->local_experts());
    if (!near_whole(p.value(), whole)) return fail(p.key() + " differs after 5 Adam steps");
  }
  if (!near_whole(moe->expert_bias, single->expert_bias)) return fail("expert_bias differs after 5 steps");
  say_matches("ep", device);
  dtrain::destroy_process_group();
  return 0;
}

// DiLoCo syncing every step with an outer SGD of rate 1, each rank a
// replica taking an inner SGD step on its share of the batch: the average
// of those steps is one SGD step on the whole batch, which one process
// takes here (10 steps, within 1e-5).
int diloco_equivalence(const std::string& backend, torch::Device device) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  auto build = [&] {
    torch::manual_seed(5);
    torch::nn::Sequential m(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 2));
    m->to(device);
    return m;
  };
  auto single = build(), mine = build();
  torch::optim::SGD single_sgd(single->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD inner(mine->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD outer(mine->parameters(), torch::optim::SGDOptions(1.0));
  dtrain::local_sgd::DiLoCo diloco({mine->parameters()}, inner, outer,
                                   dtrain::local_sgd::DiLoCoOptions().sync_every(1));
  torch::manual_seed(1000);
  for (int step = 0; step < 10; ++step) {
    const auto x = torch::randn({2 * world, 6}).to(device), y = torch::randn({2 * world, 2}).to(device);
    single_sgd.zero_grad();
    torch::mse_loss(single->forward(x), y).backward();
    single_sgd.step();
    inner.zero_grad();
    torch::mse_loss(mine->forward(x.narrow(0, 2 * rank, 2)), y.narrow(0, 2 * rank, 2)).backward();
    diloco.step();
  }
  const auto want = single->parameters(), got = mine->parameters();
  for (size_t i = 0; i < got.size(); ++i)
    if (!near_whole(got[i], want[i])) return fail("parameter " + std::to_string(i) + " differs after 10 steps");
  say_matches("diloco", device);
  dtrain::destroy_process_group();
  return 0;
}
