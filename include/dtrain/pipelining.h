#pragma once

// torch.distributed.pipelining for libtorch: a model cut into stages, each
// on its own rank, trained on microbatches that flow through the stages so
// that the ranks work at once.
//
//   namespace pp = dtrain::pipelining;
//   auto parts = pp::split_sequential(model, /*num_stages=*/2);   // Sequential pieces
//   pp::PipelineStage stage(parts[rank], rank, 2, pp::PipelineStageOptions().group(g));
//   pp::Schedule1F1B schedule(stage, /*n_microbatches=*/8, loss_fn);
//   if (stage.is_first()) schedule.step(x);                     // the whole batch
//   else schedule.step(y, &losses);                  // the targets; one loss per microbatch
//   optimizer.step();                                           // on the stage's parameters
//
// A stage's module is any module with `Tensor forward(Tensor)`: one tensor
// in and one out per stage (a stage that needs several inputs takes them
// stacked or concatenated in one tensor). Shapes are learnt each step (a
// stage sends the shape of its first microbatch's output ahead, so steps
// may differ in batch size); a stage whose microbatches' outputs differ in
// shape names itself and the microbatch. Each step splits the batch into
// n_microbatches equal chunks along dim 0, runs the schedule's forwards and
// backwards, and divides the stage's gradients by n_microbatches (PyTorch's
// scale_grads), so a step accumulates what one batch would: .grad is not
// zeroed by the step.
//
// Stage s lives on rank s mod p of the pipeline's group (p ranks): one
// stage per rank for ScheduleGPipe and Schedule1F1B, v per rank for
// ScheduleInterleaved1F1B and ScheduleLoopedBFS (rank r holds r, r+p, ...);
// ScheduleZBVZeroBubble places two per rank in a V (r and 2p - 1 - r).
// A stage whose module is a DistributedDataParallel or a
// FullyShardedDataParallel (over another group, the data-parallel one, or
// an HSDP mesh) reduces its gradients once per step, in the last
// microbatch's backward (an FSDP stage keeps the unsharded gradients of the
// earlier microbatches until then, as PyTorch's does).
// See docs/pipelining.md.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtrain/arg.h"
#include "dtrain/process_group.h"

namespace dtrain {
template <typename ModuleType>
class DistributedDataParallel;
template <typename ModuleType>
class FullyShardedDataParallel;
namespace detail {
class FSDPCore;
void fsdp_begin_microbatches(FSDPCore& core, bool on);  // src/pipelining/stage.cpp
void fsdp_sync(FSDPCore& core, bool on);
}  // namespace detail
}  // namespace dtrain

namespace dtrain::pipelining {

struct PipelineStageOptions {
  // The pipeline's group (its ranks hold the stages); null: the default group.
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, group) = nullptr;
};

namespace detail {

// How a stage runs its module, and how it turns the gradient
// synchronization of a DDP- or FSDP-wrapped module off and on.
struct StageModule {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(at::Tensor)> forward;
  // Null for a plain module. set_sync(false) before the step's forwards and
  // backwards; sync_last_backward() right before the last backward of the
  // step, which then reduces everything accumulated; set_sync(true) after.
  std::function<void(bool)> set_sync;
  std::function<void()> sync_last_backward;
  // The tensors whose gradients the step accumulates (null: the module's
  // parameters; an FSDP stage's: its shards).
  std::function<std::vector<at::Tensor>()> parameters;
  bool fsdp = false;  // its backward cannot be split in two (zero bubble)
};

template <typename M>
struct IsDdp : std::false_type {};
template <typename M>
struct IsDdp<DistributedDataParallel<M>> : std::true_type {};
template <typename M>
struct IsFsdp : std::false_type {};
template <typename M>
struct IsFsdp<FullyShardedDataParallel<M>> : std::true_type {};

template <typename M>
StageModule stage_module(std::shared_ptr<M> m) {
  StageModule s;
  s.forward = [raw = m.get()](at::Tensor x) -> at::Tensor { return raw->forward(std::move(x)); };
  if constexpr (IsDdp<M>::value) {
    auto& engine = m->engine();
    s.set_sync = [&engine](bool on) { engine.set_sync(on); };
    s.sync_last_backward = [&engine] { engine.sync_next_backward(); };
  } else if constexpr (IsFsdp<M>::value) {
    auto& engine = m->engine();
    s.set_sync = [&engine](bool on) {
      fsdp_sync(engine, on);
      fsdp_begin_microbatches(engine, !on);
    };
    s.sync_last_backward = [&engine] { fsdp_sync(engine, true); };
    s.parameters = [raw = m.get()] { return raw->parameters(); };
    s.fsdp = true;
  }
  s.module = std::move(m);
  return s;
}

StageModule stage_module(torch::nn::AnyModule m);
struct StageState;

}  // namespace detail

class PipelineStage {
 public:
  // `module` runs stage `stage_index` of `num_stages` on this rank.
  template <typename M>
  PipelineStage(std::shared_ptr<M> module, int stage_index, int num_stages,
                const PipelineStageOptions& options = PipelineStageOptions())
      : PipelineStage(detail::stage_module(std::move(module)), stage_index, num_stages, options) {}
  template <typename Impl>
  PipelineStage(torch::nn::ModuleHolder<Impl> module, int stage_index, int num_stages,
                const PipelineStageOptions& options = PipelineStageOptions())
      : PipelineStage(module.ptr(), stage_index, num_stages, options) {}
  PipelineStage(torch::nn::AnyModule module, int stage_index, int num_stages,
                const PipelineStageOptions& options = PipelineStageOptions())
      : PipelineStage(detail::stage_module(std::move(module)), stage_index, num_stages, options) {}
  PipelineStage(detail::StageModule module, int stage_index, int num_stages,
                const PipelineStageOptions& options);

  int stage_index() const;
  int num_stages() const;
  bool is_first() const { return stage_index() == 0; }
  bool is_last() const { return stage_index() == num_stages() - 1; }
  const std::shared_ptr<torch::nn::Module>& module() const;
  const std::shared_ptr<ProcessGroup>& group() const;
  // The stage's state (one per stage, shared by the copies of this handle).
  detail::StageState& state() const { return *state_; }

 private:
  std::shared_ptr<detail::StageState> state_;
};

// `model`'s children cut into `num_stages` consecutive pieces of (as near
// as possible) equal numbers of children, the first pieces one longer.
// The pieces share the model's modules (and parameters).
std::vector<torch::nn::Sequential> split_sequential(const torch::nn::Sequential& model,
                                                    int num_stages);
// The same, cut before each child index in `split_points` (increasing,
// each in 1..size-1): k points make k + 1 pieces.
std::vector<torch::nn::Sequential> split_sequential(const torch::nn::Sequential& model,
                                                    const std::vector<int>& split_points);

// loss_fn(output, target) of one microbatch, a scalar (mean over the
// microbatch, as the loss of the whole batch would be).
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

// What the last step did on this rank.
struct ScheduleStats {
  int64_t steps = 0;
  double step_ms = 0;        // the last step, first action to last send completed
  double compute_ms = 0;     // forwards and backwards of its stages (the loss included)
  double wait_ms = 0;        // waiting for other stages' activations, gradients and sends
  double idle_fraction = 0;  // 1 - compute / step: the rank's bubble
  int peak_microbatches = 0; // most microbatches whose activations it held at once
};

namespace detail {
class Runner;
}

// PyTorch's _PipelineSchedule. Every rank of the pipeline calls step (or
// eval) once per batch, collectively:
//   - the rank holding the first stage: step(input);
//   - the rank holding the last stage: step(target, &losses) (losses gets
//     one loss per microbatch; may be null);
//   - a rank holding both (one rank, or a V): step(input, target, &losses);
//   - any other rank: step().
// Returns the last stage's output (the microbatches' outputs concatenated,
// detached) on the rank holding it, else an undefined tensor. Without a
// loss_fn, step runs the forwards only. eval runs the forwards only, under
// no grad (and the loss, when a target is given). The first step checks
// that every rank runs the same schedule, stages and n_microbatches
// (InvalidArgument naming each rank's); a stage that dies or stalls fails
// every rank within the group's timeout, naming the stage.
class PipelineSchedule {
 public:
  virtual ~PipelineSchedule();
  PipelineSchedule(const PipelineSchedule&) = delete;
  PipelineSchedule& operator=(const PipelineSchedule&) = delete;

  at::Tensor step();
  at::Tensor step(const at::Tensor& input_or_target, std::vector<at::Tensor>* losses = nullptr);
  at::Tensor step(const at::Tensor& input, const at::Tensor& target,
                  std::vector<at::Tensor>* losses = nullptr);
  at::Tensor eval();
  at::Tensor eval(const at::Tensor& input_or_target, std::vector<at::Tensor>* losses = nullptr);
  at::Tensor eval(const at::Tensor& input, const at::Tensor& target,
                  std::vector<at::Tensor>* losses = nullptr);

  int n_microbatches() const;
  ScheduleStats stats() const;

 protected:
  PipelineSchedule(int kind, std::vector<PipelineStage> stages, int n_microbatches,
                   LossFn loss_fn);

 private:
  std::unique_ptr<detail::Runner> runner_;
};

// All forwards, then all backwards: holds every microbatch's activations.
class ScheduleGPipe : public PipelineSchedule {
 public:
  ScheduleGPipe(PipelineStage stage, int n_microbatches, LossFn loss_fn = nullptr);
};

// One forward, one backward: stage s holds at most num_stages - s
// microbatches' activations, with GPipe's bubble.
class Schedule1F1B : public PipelineSchedule {
 public:
  Schedule1F1B(PipelineStage stage, int n_microbatches, LossFn loss_fn = nullptr);
};

// Several stages per rank (r, r + p, ...), microbatches in rounds of p
// (n_microbatches a multiple of p), 1F1B between them: the bubble shrinks
// by the number of stages per rank (Megatron-LM's interleaved schedule).
class ScheduleInterleaved1F1B : public PipelineSchedule {
 public:
  ScheduleInterleaved1F1B(std::vector<PipelineStage> stages, int n_microbatches,
                          LossFn loss_fn = nullptr);
};

// Zero bubble (ZB-V, Qi et al.): two stages per rank in a V — rank r holds
// stages r and 2p - 1 - r, so rank 0 holds the first and the last and calls
// step(input, target, &losses) — with each backward split into the input's
// gradient, which the previous stage waits for, and the parameters'
// gradients, which fill the bubble. n_microbatches >= 2p. The weights' half
// runs backward again to the parameters (libtorch has no partial graph
// replay), so each backward costs up to twice its layers' work.
class ScheduleZBVZeroBubble : public PipelineSchedule {
 public:
  ScheduleZBVZeroBubble(std::vector<PipelineStage> stages, int n_microbatches,
                        LossFn loss_fn = nullptr);
};

// Several stages per rank, breadth first: every microbatch through each
// local stage, then the backwards in reverse.
class ScheduleLoopedBFS : public PipelineSchedule {
 public:
  ScheduleLoopedBFS(std::vector<PipelineStage> stages, int n_microbatches,
                    LossFn loss_fn = nullptr);
};

}  // namespace dtrain::pipelining
