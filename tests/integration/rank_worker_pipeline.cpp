// rank_worker's pipeline mode: a model cut into stages over the ranks (as
// processes), trained with one of the five schedules, against one process
// training the whole model on the whole batch, on the CPU or on a GPU.

#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/dtrain.h"
#include "integration/rank_worker.h"

namespace {

namespace pp = dtrain::pipelining;

constexpr int kStagesWidth = 12;
constexpr int kStagesRows = 16;
constexpr int kStagesSteps = 5;
constexpr int kMicrobatches = 4;

// Eight children, a Linear and a Tanh per layer, so that any cut works.
torch::nn::Sequential make_layers(torch::Device device) {
  torch::manual_seed(7);
  torch::nn::Sequential m;
  for (int i = 0; i < 4; ++i) {
    m->push_back(torch::nn::Linear(kStagesWidth, kStagesWidth));
    m->push_back(torch::nn::Functional(torch::tanh));
  }
  m->to(device);
  return m;
}

at::Tensor mse(const at::Tensor& out, const at::Tensor& target) { return torch::mse_loss(out, target); }

std::unique_ptr<torch::optim::Optimizer> momentum_sgd(std::vector<torch::Tensor> params) {
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
}

std::unique_ptr<pp::PipelineSchedule> make_schedule(const std::string& kind,
                                                    std::vector<pp::PipelineStage> s) {
  if (kind == "gpipe") return std::make_unique<pp::ScheduleGPipe>(s[0], kMicrobatches, mse);
  if (kind == "1f1b") return std::make_unique<pp::Schedule1F1B>(s[0], kMicrobatches, mse);
  if (kind == "interleaved")
    return std::make_unique<pp::ScheduleInterleaved1F1B>(s, kMicrobatches, mse);
  if (kind == "looped-bfs") return std::make_unique<pp::ScheduleLoopedBFS>(s, kMicrobatches, mse);
  if (kind == "zbv") return std::make_unique<pp::ScheduleZBVZeroBubble>(s, kMicrobatches, mse);
  throw std::invalid_argument("rank_worker: no schedule '" + kind + "'");
}

}  // namespace

int pipeline_equivalence(const std::string& kind, const std::string& backend, torch::Device device) {
  dtrain::init_process_group(dtrain::InitOptions().backend(backend));
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  const bool one_per_rank = kind == "gpipe" || kind == "1f1b";
  const int stages = one_per_rank ? world : 2 * world;
  // Stage s on rank s mod world; ZB-V puts rank r's two in a V.
  std::vector<int> held;
  if (kind == "zbv") held = {rank, 2 * world - 1 - rank};
  else for (int s = rank; s < stages; s += world) held.push_back(s);
  const bool first = rank == 0;
  const bool last = kind == "zbv" ? rank == 0 : (stages - 1) % world == rank;

  auto reference = make_layers(device), model = make_layers(device);
  auto reference_opt = momentum_sgd(reference->parameters());
  auto pieces = pp::split_sequential(model, stages);
  std::vector<pp::PipelineStage> mine;
  std::vector<torch::Tensor> params;
  for (int s : held) {
    mine.emplace_back(pieces[s], s, stages);
    for (const auto& p : pieces[s]->parameters()) params.push_back(p);
  }
  auto opt = momentum_sgd(params);
  auto schedule = make_schedule(kind, mine);
  torch::manual_seed(11);
  for (int step = 0; step < kStagesSteps; ++step) {
    const auto x = torch::randn({kStagesRows, kStagesWidth}).to(device);
    const auto y = torch::randn({kStagesRows, kStagesWidth}).to(device);
    opt->zero_grad();
    std::vector<at::Tensor> losses;
    if (first && last) schedule->step(x, y, &losses);
    else if (first) schedule->step(x);
    else if (last) schedule->step(y, &losses);
    else schedule->step();
    if (last && losses.size() != static_cast<size_t>(kMicrobatches))
      return fail("the last stage returned " + std::to_string(losses.size()) + " losses");
    opt->step();
    reference_opt->zero_grad();
    mse(reference->forward(x), y).backward();
    reference_opt->step();
  }
  // The held stages' children (the pieces share the model's) against the
  // same children of the reference.
  const auto want = reference->named_parameters();
  const int per = 8 / stages;
  int compared = 0;
  for (const auto& item : model->named_parameters()) {
    const int stage = std::stoi(item.key().substr(0, item.key().find('.'))) / per;
    if (std::find(held.begin(), held.end(), stage) == held.end()) continue;
    if (!torch::allclose(item.value().cpu(), want[item.key()].cpu(), 1e-5, 1e-6))
      return fail("stage " + std::to_string(stage) + " parameter " + item.key() +
                  " differs from single-process training");
    ++compared;
  }
  if (compared == 0) return fail("no parameter of this rank's stages was compared");
  std::cout << "rank " << rank << " pipeline " << kind << " (" << stages << " stages) matches "
            << "single-process training on " << dtrain::default_group()->backend_name()
            << " with tensors on " << device << std::endl;
  dtrain::destroy_process_group();
  return 0;
}
