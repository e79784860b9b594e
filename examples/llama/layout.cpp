// dtrain-llama's layout: the (pp, dp, tp) mesh, this rank's stage of the
// model, and one training step of it (job.h).

#include <stdexcept>

#include "job.h"

namespace llama {
namespace pp = dtrain::pipelining;

namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw dtrain::InvalidArgument("dtrain-llama: " + what);
}

std::string n(int64_t v) { return std::to_string(v); }

}  // namespace

Placement place(Flags& f) {
  const int world = dtrain::get_world_size();
  require(f.tp >= 1 && f.pp >= 1 && f.dp >= 0, "--tp, --pp and --dp must be positive");
  if (f.dp == 0) {
    require(world % (f.tp * f.pp) == 0, "--tp " + n(f.tp) + " x --pp " + n(f.pp) + " does not divide the " +
                                            n(world) + " ranks");
    f.dp = world / (f.tp * f.pp);
  }
  require(f.tp * f.pp * f.dp == world, "--tp " + n(f.tp) + " x --pp " + n(f.pp) + " x --dp " + n(f.dp) +
                                           " is not the " + n(world) + " ranks");
  require(f.model.layers >= f.pp, n(f.model.layers) + " layers cannot make " + n(f.pp) + " pipeline stages");
  require(f.batch % f.dp == 0, "--batch " + n(f.batch) + " does not split over " + n(f.dp) + " replicas");
  require(f.pp == 1 || (f.batch / f.dp) % f.microbatches == 0,
          "--batch " + n(f.batch) + " gives each replica " + n(f.batch / f.dp) +
              " sequences, which --microbatches " + n(f.microbatches) + " does not divide");
  require(!f.sequence_parallel || f.model.seq % f.tp == 0,
          "--seq " + n(f.model.seq) + " does not split over --tp " + n(f.tp) + " (sequence parallelism)");
  require(f.data_parallel == "ddp" || f.data_parallel == "fsdp", "--data-parallel is ddp or fsdp");
  const dtrain::DeviceMesh mesh({f.pp, f.dp, f.tp}, {"pp", "dp", "tp"});
  Placement at;
  at.pp_rank = mesh.get_local_rank("pp");
  at.dp_rank = mesh.get_local_rank("dp");
  at.tp_rank = mesh.get_local_rank("tp");
  at.pp = mesh.get_group("pp");
  at.dp = mesh.get_group("dp");
  at.tp = mesh.get_group("tp");
  // Layers dealt out evenly, the first stages one more.
  const int64_t base = f.model.layers / f.pp, extra = f.model.layers % f.pp;
  at.first_layer = at.pp_rank * base + std::min<int64_t>(at.pp_rank, extra);
  at.last_layer = at.first_layer + base + (at.pp_rank < extra ? 1 : 0);
  return at;
}

Trainer::Trainer(const Flags& f, const Placement& at) : f_(f), at_(at) {
  const Layout layout{at.tp, f.sequence_parallel, f.checkpoint_activations};
  const bool head = at.last_stage(f);
  stage_ = Stage(f.model, layout,
                 initial_values(f.model, f.seed, at.first_layer, at.last_layer, at.first_stage(), head),
                 at.first_layer, at.last_layer, at.first_stage(), head);
  std::vector<at::Tensor> params;
  if (f.data_parallel == "fsdp") {
    fsdp_ = std::make_shared<dtrain::FullyShardedDataParallel<StageImpl>>(
        stage_.ptr(), dtrain::FSDPOptions().process_group(at.dp));
    params = fsdp_->parameters();
  } else {
    ddp_ = std::make_shared<dtrain::DistributedDataParallel<StageImpl>>(
        stage_.ptr(), dtrain::DDPOptions().process_group(at.dp));
    params = stage_->parameters();
  }
  optimizer_ = std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(f.lr).weight_decay(0.1).betas({0.9, 0.95}));
  if (f.pp == 1) return;
  const auto on_pp = pp::PipelineStageOptions().group(at.pp);
  pipeline_ = fsdp_ ? std::make_unique<pp::PipelineStage>(fsdp_, at.pp_rank, f.pp, on_pp)
                    : std::make_unique<pp::PipelineStage>(ddp_, at.pp_rank, f.pp, on_pp);
  auto tp = at.tp;
  schedule_ = std::make_unique<pp::Schedule1F1B>(
      *pipeline_, static_cast<int>(f.microbatches),
      [tp](const at::Tensor& logits, const at::Tensor& target) { return loss(logits, target, tp); });
}

Trainer::~Trainer() = default;

at::Tensor Trainer::step(const at::Tensor& rows) {
  const auto input = rows.narrow(1, 0, f_.model.seq), target = rows.narrow(1, 1, f_.model.seq);
  optimizer_->zero_grad();
  at::Tensor mean;
  if (!schedule_) {
    const auto logits = fsdp_ ? fsdp_->forward(input) : ddp_->forward(input);
    mean = loss(logits, target, at_.tp);
    mean.backward();
  } else if (at_.first_stage()) {
    schedule_->step(input);
  } else if (at_.last_stage(f_)) {
    std::vector<at::Tensor> losses;
    schedule_->step(target, &losses);
    mean = torch::stack(losses).mean();
  } else {
    schedule_->step();
  }
  {
    dtrain::TimelineSpan span("optimizer.step");
    optimizer_->step();
  }
  return mean.defined() ? mean.detach() : mean;
}

void Trainer::add_weights_to(dtrain::checkpoint::DistributedState& state) {
  if (fsdp_) dtrain::checkpoint::add_fsdp_parameters(state, *fsdp_);
  else dtrain::checkpoint::add_module(state, *stage_);
}

void Trainer::add_to(dtrain::checkpoint::DistributedState& state) {
  if (fsdp_) {
    dtrain::checkpoint::add_fsdp(state, *fsdp_, *optimizer_, "model/");  // TP layers: per parameter
    return;
  }
  dtrain::checkpoint::add_module(state, *stage_, "model/");
  dtrain::checkpoint::add_optimizer(state, *optimizer_, *stage_, "model/");
}

}  // namespace llama
