// PipelineStage and split_sequential.

#include <torch/nn/modules/container/sequential.h>

#include "common/enforce.h"
#include "dtrain/distributed.h"
#include "dtrain/fsdp.h"
#include "dtrain/pipelining.h"
#include "pipelining/stage_state.h"

namespace dtrain::detail {

void fsdp_begin_microbatches(FSDPCore& core, bool on) {
  if (on)
    core.begin_microbatches();
  else
    core.end_microbatches();
}

void fsdp_sync(FSDPCore& core, bool on) { core.set_sync(on); }

}  // namespace dtrain::detail

namespace dtrain::pipelining {

namespace detail {

StageModule stage_module(torch::nn::AnyModule m) {
  StageModule s;
  s.module = m.ptr();
  s.forward = [m](at::Tensor x) mutable { return m.forward<at::Tensor>(std::move(x)); };
  return s;
}

}  // namespace detail

PipelineStage::PipelineStage(detail::StageModule module, int stage_index, int num_stages,
                             const PipelineStageOptions& options)
    : state_(std::make_shared<detail::StageState>()) {
  DTRAIN_CHECK_ARG(module.module && module.forward, "PipelineStage: the module is null");
  DTRAIN_CHECK_ARG(num_stages >= 1, "PipelineStage: num_stages must be at least 1, got ",
                   num_stages);
  DTRAIN_CHECK_ARG(stage_index >= 0 && stage_index < num_stages, "PipelineStage: stage_index ",
                   stage_index, " must lie in 0..", num_stages - 1, " (num_stages ", num_stages,
                   ")");
  auto group = options.group() ? options.group() : default_group();
  DTRAIN_CHECK_ARG(group->rank() >= 0, "PipelineStage: this rank is not a member of group '",
                   group->name(), "'");
  const auto params = detail::parameters_of(module);
  if (!params.empty()) state_->device = params.front().device();
  state_->module = std::move(module);
  state_->index = stage_index;
  state_->num_stages = num_stages;
  state_->group = std::move(group);
}

int PipelineStage::stage_index() const { return state_->index; }
int PipelineStage::num_stages() const { return state_->num_stages; }
const std::shared_ptr<torch::nn::Module>& PipelineStage::module() const {
  return state_->module.module;
}
const std::shared_ptr<ProcessGroup>& PipelineStage::group() const { return state_->group; }

std::vector<torch::nn::Sequential> split_sequential(const torch::nn::Sequential& model,
                                                    const std::vector<int>& split_points) {
  const int n = static_cast<int>(model->size());
  int previous = 0;
  for (int point : split_points) {
    DTRAIN_CHECK_ARG(point > previous && point < n, "split_sequential: split points [",
                     dtrain::detail::join(split_points), "] must increase and lie in 1..", n - 1,
                     " (the model has ", n, " children)");
    previous = point;
  }
  std::vector<torch::nn::Sequential> pieces;
  std::vector<int> bounds = split_points;
  bounds.insert(bounds.begin(), 0);
  bounds.push_back(n);
  // Each child keeps its name ("3" stays "3"), so a piece's state_dict keys
  // are the model's.
  const auto names = model->named_children().keys();
  for (size_t k = 0; k + 1 < bounds.size(); ++k) {
    torch::nn::Sequential piece;
    for (int i = bounds[k]; i < bounds[k + 1]; ++i) piece->push_back(names[i], model->begin()[i]);
    pieces.push_back(piece);
  }
  return pieces;
}

std::vector<torch::nn::Sequential> split_sequential(const torch::nn::Sequential& model,
                                                    int num_stages) {
  const int n = static_cast<int>(model->size());
  DTRAIN_CHECK_ARG(num_stages >= 1 && num_stages <= n, "split_sequential: num_stages ",
                   num_stages, " must lie in 1..", n, " (the model has ", n, " children)");
  std::vector<int> points;
  int at = 0;
  for (int k = 0; k + 1 < num_stages; ++k) {
    at += n / num_stages + (k < n % num_stages ? 1 : 0);
    points.push_back(at);
  }
  return split_sequential(model, points);
}

}  // namespace dtrain::pipelining
