#pragma once

// Training across slow links: replicas that step on their own and
// synchronise rarely, so that a step does not wait for the whole gradient
// to cross the network.
//
//  - Post-local SGD, as PyTorch's torch.distributed.algorithms has it: DDP
//    averages gradients for the first steps (post_local_sgd_hook), then
//    each replica steps alone (or within a subgroup, its host) and a
//    PeriodicModelAverager averages the parameters every `period` steps
//    (PostLocalSGDOptimizer runs it after the optimizer's step).
//
//      dtrain::DistributedDataParallel ddp(net);
//      ddp.register_comm_hook(local_sgd::post_local_sgd_hook(
//          local_sgd::PostLocalSGDState().start_local_sgd_iter(100).post_local_gradient_allreduce(false)));
//      torch::optim::SGD sgd(ddp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
//      local_sgd::PeriodicModelAverager averager(/*period=*/4, /*warmup_steps=*/100);
//      local_sgd::PostLocalSGDOptimizer opt(sgd, averager);
//      ... loss.backward(); opt.step();
//
//  - DiLoCo (Douillard et al., arXiv 2311.08105): each replica takes
//    sync_every (H) steps of its inner optimizer (AdamW, typically) on its
//    own data; then the replicas average their pseudo-gradients, the
//    global parameters minus their own, and an outer optimizer (SGD with
//    Nesterov momentum, typically) steps the global parameters with that
//    average as their gradient. Every replica then continues from the new
//    global parameters. An outer SGD step of rate 1 without momentum is
//    model averaging (LocalSGD).
//
//  - Streaming DiLoCo (arXiv 2501.18512): the parameters in F fragments
//    (layers, say), each synchronised at its own step of the H (fragment i
//    at offset floor(H / F * (i + 1)), as torchft places them), so the
//    bytes of a sync are a fragment's, not the model's; with sync_delay
//    (the paper's tau) a fragment's average runs in the background for
//    that many inner steps before its outer step is applied; then the
//    fragment becomes (1 - alpha) x the new global values + alpha x the
//    replica's own (fragment_update_alpha; 0 takes the global ones).
//
//      torch::optim::AdamW inner(model->parameters(), torch::optim::AdamWOptions(4e-4));
//      torch::optim::SGD outer(model->parameters(), torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
//      local_sgd::DiLoCo diloco({model->parameters()}, inner, outer, local_sgd::DiLoCoOptions().sync_every(32));
//      ... loss.backward(); diloco.step();   // the inner step, then the syncs due
//
// The replicas are the ranks of `group` (one rank each), or, for replicas
// of several ranks (DDP, FSDP, TP inside each), the group of the ranks
// holding the same part in every replica (a DeviceMesh's replicate
// dimension). Every blocking wait is bounded by the group's timeout.
// See docs/slow-links.md.

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/arg.h"
#include "dtrain/ddp/comm_hooks.h"
#include "dtrain/process_group.h"
#include "dtrain/work.h"

namespace dtrain::local_sgd {
class DiLoCo;
}
namespace dtrain::ft {
class Manager;
}

namespace dtrain::checkpoint {
struct DistributedState;
// DiLoCo's own state, under "<prefix>diloco/": the inner-step clock, each
// fragment's global values, and an average not applied yet (one still in
// flight when save() runs is waited for and saved); the same on every
// replica. Between syncs the replicas' parameters and inner optimizer
// states differ, so each replica checkpoints on its own (its ranks as
// SaveOptions::process_group, a directory of its own), with add_module for
// its parameters and add_optimizer for the inner and the outer optimizer
// under two prefixes. Loaded, training goes on bitwise as if never stopped.
void add_diloco(DistributedState& state, local_sgd::DiLoCo& diloco, const std::string& prefix = "");
}  // namespace dtrain::checkpoint

namespace dtrain::local_sgd {

// PyTorch's PeriodicModelAverager. Call average_parameters() after every
// optimizer step; the call numbered warmup_steps and every period-th one
// after it average `params` over `group` (null: the default group): one
// all_reduce of them flattened, each divided by the group's size first,
// as PyTorch does. Parameters without a gradient are left out (PyTorch's
// get_params_to_average). Collective on the calls that average.
class PeriodicModelAverager {
 public:
  explicit PeriodicModelAverager(int64_t period, int64_t warmup_steps = 0,
                                 std::shared_ptr<ProcessGroup> group = nullptr);
  void average_parameters(const std::vector<at::Tensor>& params);
  int64_t period() const { return period_; }
  int64_t warmup_steps() const { return warmup_steps_; }
  // Calls so far; set_step restores it from a checkpoint.
  int64_t step() const { return step_; }
  void set_step(int64_t step);

 private:
  int64_t period_, warmup_steps_, step_ = 0;
  std::shared_ptr<ProcessGroup> group_;
};

// PyTorch's PostLocalSGDOptimizer: step() steps `optimizer`, then hands its
// parameters to `averager`. Both must outlive it.
class PostLocalSGDOptimizer {
 public:
  PostLocalSGDOptimizer(torch::optim::Optimizer& optimizer, PeriodicModelAverager& averager);
  void step();
  void zero_grad();
  torch::optim::Optimizer& optimizer() { return optimizer_; }

 private:
  torch::optim::Optimizer& optimizer_;
  PeriodicModelAverager& averager_;
};

// PyTorch's PostLocalSGDState, for post_local_sgd_hook.
struct PostLocalSGDState {
  // DDP's backward passes that average over its whole group first.
  DTRAIN_ARG(int64_t, start_local_sgd_iter) = 0;
  // From then on: average gradients within `subgroup` (PyTorch's default
  // there is the ranks of this host), or, with
  // post_local_gradient_allreduce false, not at all.
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, subgroup) = nullptr;
  DTRAIN_ARG(bool, post_local_gradient_allreduce) = true;
};

// PyTorch's post_localSGD_hook: DDP's all_reduce over its group for the
// first start_local_sgd_iter backward passes, then over the subgroup (or
// none). With post_local_gradient_allreduce and no subgroup, it is an
// InvalidArgument at DDP's first bucket after the start, naming the
// missing subgroup (dtrain makes no groups inside a hook).
CommHook post_local_sgd_hook(const PostLocalSGDState& state);

struct DiLoCoOptions {
  // Inner steps between two syncs of each fragment (H).
  DTRAIN_ARG(int64_t, sync_every) = 32;
  // The replicas: one rank of each (null: the default group).
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, group) = nullptr;
  // Streaming DiLoCo: inner steps a fragment's average runs in the
  // background before its outer step (tau; below sync_every).
  DTRAIN_ARG(int64_t, sync_delay) = 0;
  // Streaming DiLoCo's mixing: a synced fragment becomes
  // (1 - alpha) x global + alpha x its own values. In [0, 1].
  DTRAIN_ARG(double, fragment_update_alpha) = 0.0;
  // Average the pseudo-gradients in bfloat16 (half the bytes; the outer
  // step in the parameters' dtype).
  DTRAIN_ARG(bool, bf16_exchange) = false;
  // Fault tolerance (dtrain/ft/manager.h, torchft's DiLoCo(manager, ...)):
  // the replicas are the manager's quorum, which may lose and regain
  // members between syncs. Each sync is one of the manager's steps: a
  // quorum at the sync (a replica behind heals there, taking the whole
  // state of a live peer: parameters, both optimizers and this object's
  // global values and clock, so build the manager's DistributedState with
  // add_module, add_optimizer for each and add_diloco), the average over
  // the members that did not just heal, and should_commit(); a sync that
  // does not commit is dropped (the fragment goes back to its global
  // values, as torchft does). Needs a synchronous quorum
  // (ManagerOptions::async_quorum(false)), CPU parameters, no `group` and
  // no sync_delay (the manager runs one step at a time); construction is
  // then not collective, and the options are compared at every sync.
  using ManagerPtr = ft::Manager*;
  DTRAIN_ARG(ManagerPtr, manager) = nullptr;
};

// DiLoCo and Streaming DiLoCo over `fragments` (one: DiLoCo): lists of
// parameters, each of one dtype and device, that together are exactly the
// parameters of `inner` and of `outer`. The global values are kept here;
// during an outer step `outer` sees the parameters holding them, their
// .grad the averaged pseudo-gradient (other parameters' gradients set
// aside meanwhile). Construction is collective: the replicas compare their
// options and fragments, and start from replica 0's values (broadcast, as
// DDP does); with a manager it is not (see DiLoCoOptions::manager). The
// optimizers, parameters and manager must outlive it.
class DiLoCo {
 public:
  DiLoCo(std::vector<std::vector<at::Tensor>> fragments, torch::optim::Optimizer& inner,
         torch::optim::Optimizer& outer, const DiLoCoOptions& options = DiLoCoOptions());
  ~DiLoCo();
  DiLoCo(const DiLoCo&) = delete;
  DiLoCo& operator=(const DiLoCo&) = delete;

  // The inner optimizer's step, then each fragment's sync that is due:
  // collective over the group on those steps.
  void step();
  // Inner steps so far (the schedule's clock; checkpoint::add_diloco
  // keeps it).
  int64_t local_step() const;
  // The global values each fragment last synced to, flat, in fragment
  // order (to evaluate the global model, for example).
  std::vector<at::Tensor> global_parameters() const;
  // Bytes this rank sent in its largest sync so far (one fragment's
  // pseudo-gradients; half with bf16_exchange).
  int64_t peak_sync_bytes() const;

 private:
  friend void checkpoint::add_diloco(checkpoint::DistributedState&, DiLoCo&, const std::string&);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::local_sgd
