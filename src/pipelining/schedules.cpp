// The schedule classes: each is the runner with its order.

#include "dtrain/pipelining.h"
#include "pipelining/runner.h"

namespace dtrain::pipelining {

using detail::Runner;
using detail::ScheduleKind;
using detail::StepArgs;

PipelineSchedule::PipelineSchedule(int kind, std::vector<PipelineStage> stages, int n_microbatches,
                                   LossFn loss_fn)
    : runner_(std::make_unique<Runner>(static_cast<ScheduleKind>(kind), std::move(stages),
                                       n_microbatches, std::move(loss_fn))) {}

PipelineSchedule::~PipelineSchedule() = default;

at::Tensor PipelineSchedule::step() { return runner_->run(StepArgs{}); }

at::Tensor PipelineSchedule::step(const at::Tensor& input_or_target,
                                  std::vector<at::Tensor>* losses) {
  return runner_->run(runner_->one_argument(input_or_target, losses, true, "step"));
}

at::Tensor PipelineSchedule::step(const at::Tensor& input, const at::Tensor& target,
                                  std::vector<at::Tensor>* losses) {
  return runner_->run(StepArgs{&input, &target, losses, true, "step"});
}

at::Tensor PipelineSchedule::eval() {
  return runner_->run(StepArgs{nullptr, nullptr, nullptr, false, "eval"});
}

at::Tensor PipelineSchedule::eval(const at::Tensor& input_or_target,
                                  std::vector<at::Tensor>* losses) {
  return runner_->run(runner_->one_argument(input_or_target, losses, false, "eval"));
}

at::Tensor PipelineSchedule::eval(const at::Tensor& input, const at::Tensor& target,
                                  std::vector<at::Tensor>* losses) {
  return runner_->run(StepArgs{&input, &target, losses, false, "eval"});
}

int PipelineSchedule::n_microbatches() const { return runner_->n_microbatches(); }
ScheduleStats PipelineSchedule::stats() const { return runner_->stats(); }

ScheduleGPipe::ScheduleGPipe(PipelineStage stage, int n_microbatches, LossFn loss_fn)
    : PipelineSchedule(static_cast<int>(ScheduleKind::GPIPE), {std::move(stage)}, n_microbatches,
                       std::move(loss_fn)) {}

Schedule1F1B::Schedule1F1B(PipelineStage stage, int n_microbatches, LossFn loss_fn)
    : PipelineSchedule(static_cast<int>(ScheduleKind::ONE_F_ONE_B), {std::move(stage)},
                       n_microbatches, std::move(loss_fn)) {}

ScheduleInterleaved1F1B::ScheduleInterleaved1F1B(std::vector<PipelineStage> stages,
                                                 int n_microbatches, LossFn loss_fn)
    : PipelineSchedule(static_cast<int>(ScheduleKind::INTERLEAVED_1F1B), std::move(stages),
                       n_microbatches, std::move(loss_fn)) {}

ScheduleZBVZeroBubble::ScheduleZBVZeroBubble(std::vector<PipelineStage> stages,
                                             int n_microbatches, LossFn loss_fn)
    : PipelineSchedule(static_cast<int>(ScheduleKind::ZBV_ZERO_BUBBLE), std::move(stages),
                       n_microbatches, std::move(loss_fn)) {}

ScheduleLoopedBFS::ScheduleLoopedBFS(std::vector<PipelineStage> stages, int n_microbatches,
                                     LossFn loss_fn)
    : PipelineSchedule(static_cast<int>(ScheduleKind::LOOPED_BFS), std::move(stages),
                       n_microbatches, std::move(loss_fn)) {}

}  // namespace dtrain::pipelining
