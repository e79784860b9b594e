// dtrain-llama's layout: the (pp, dp, cp, tp) mesh, this rank's stage of the
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

// What context parallelism needs of the other flags.
void require_context_parallel(const Flags& f) {
  require(f.cp_attention == "ring" || f.cp_attention == "ulysses", "--cp-attention is ring or ulysses");
  require(f.cp > 1 || f.cp_attention == "ring", "--cp-attention " + f.cp_attention + " without --cp");
  if (f.cp == 1) return;
  require(f.model.seq % (2 * f.cp) == 0, "--seq " + n(f.model.seq) + " does not cut into the " + n(2 * f.cp) +
                                             " chunks of --cp " + n(f.cp) + " (an early and a late one per rank)");
  require(f.model.dropout == 0, "--dropout with --cp " + n(f.cp) +
                                    ": context-parallel attention has no dropout on its probabilities");
  require(f.sync == "ddp", "--sync diloco with --cp " + n(f.cp) +
                               ": a replica's context-parallel ranks must average their gradients every step");
  require(f.cp_attention == "ring" || (f.model.heads / f.tp) % f.cp == 0,
          "--cp-attention ulysses: the " + n(f.model.heads / f.tp) + " heads of a tensor-parallel rank do not "
          "split over --cp " + n(f.cp));
}

}  // namespace

Placement place(Flags& f) {
  const int world = dtrain::get_world_size();
  require(f.tp >= 1 && f.pp >= 1 && f.dp >= 0 && f.cp >= 1, "--tp, --pp, --cp and --dp must be positive");
  const int model_ranks = f.tp * f.pp * f.cp;  // the ranks of one replica
  const std::string sizes = "--tp " + n(f.tp) + " x --pp " + n(f.pp) + (f.cp > 1 ? " x --cp " + n(f.cp) : "");
  if (f.dp == 0) {
    require(world % model_ranks == 0, sizes + " does not divide the " + n(world) + " ranks");
    f.dp = world / model_ranks;
  }
  require(model_ranks * f.dp == world, sizes + " x --dp " + n(f.dp) + " is not the " + n(world) + " ranks");
  require_context_parallel(f);
  require(f.model.layers >= f.pp, n(f.model.layers) + " layers cannot make " + n(f.pp) + " pipeline stages");
  require(f.batch % f.dp == 0, "--batch " + n(f.batch) + " does not split over " + n(f.dp) + " replicas");
  require(f.pp == 1 || (f.batch / f.dp) % f.microbatches == 0,
          "--batch " + n(f.batch) + " gives each replica " + n(f.batch / f.dp) +
              " sequences, which --microbatches " + n(f.microbatches) + " does not divide");
  require(!f.sequence_parallel || (f.model.seq / f.cp) % f.tp == 0,
          "--seq " + n(f.model.seq) + (f.cp > 1 ? " over --cp " + n(f.cp) : "") + " does not split over --tp " +
              n(f.tp) + " (sequence parallelism)");
  require(f.data_parallel == "ddp" || f.data_parallel == "fsdp", "--data-parallel is ddp or fsdp");
  const bool diloco = f.sync == "diloco";
  require(f.sync == "ddp" || diloco, "--sync is ddp or diloco");
  require(!diloco || (f.data_parallel == "ddp" && f.model.experts == 0),
          "--sync diloco makes each data-parallel rank a replica of its own: not with --data-parallel fsdp or "
          "--experts");
  require(!diloco || f.export_safetensors.empty(),
          "--sync diloco with --export-safetensors: the replicas' parameters differ between syncs (export one "
          "replica's checkpoint instead)");
  require(f.ep >= 1 && f.dp % f.ep == 0, "--ep " + n(f.ep) + " does not divide --dp " + n(f.dp) +
                                            " (expert-parallel ranks are data-parallel ones)");
  require(f.ep == 1 || f.model.experts > 0, "--ep " + n(f.ep) + " without --experts");
  // (pp, edp, ep, cp, tp): dp is (edp, ep), consecutive data-parallel
  // ranks sharing their experts.
  const dtrain::DeviceMesh mesh({f.pp, f.dp / f.ep, f.ep, f.cp, f.tp}, {"pp", "edp", "ep", "cp", "tp"});
  const auto dp = mesh[{"edp", "ep"}].flatten("dp");
  Placement at;
  at.pp_rank = mesh.get_local_rank("pp");
  at.dp_rank = dp.get_local_rank("dp");
  at.tp_rank = mesh.get_local_rank("tp");
  at.pp = mesh.get_group("pp");
  at.dp = dp.get_group("dp");
  at.tp = mesh.get_group("tp");
  at.ep = mesh.get_group("ep");
  at.edp = mesh.get_group("edp");
  at.cp = mesh.get_group("cp");
  // The parameters are the same on the ranks of dp and of cp (each its own
  // tokens): their gradients are averaged over both, as torchtitan's FSDP
  // over dp_shard x cp.
  at.dp_cp = f.cp > 1 ? mesh[{"edp", "ep", "cp"}].flatten("dp_cp").get_group("dp_cp") : at.dp;
  // An expert lives on the edp ranks of every cp rank: its gradient is
  // averaged over those.
  at.edp_cp = f.cp > 1 ? mesh[{"edp", "cp"}].flatten("edp_cp").get_group("edp_cp") : at.edp;
  at.stage = mesh[{"edp", "ep", "cp", "tp"}].flatten("stage").get_group("stage");
  if (diloco) {  // each replica checkpoints on its own, in a directory of its own
    at.replica = mesh[{"pp", "tp"}].flatten("replica").get_group("replica");
    f.checkpoint_dir += "/replica-" + n(at.dp_rank);
  }
  // Layers dealt out evenly, the first stages one more.
  const int64_t base = f.model.layers / f.pp, extra = f.model.layers % f.pp;
  at.first_layer = at.pp_rank * base + std::min<int64_t>(at.pp_rank, extra);
  at.last_layer = at.first_layer + base + (at.pp_rank < extra ? 1 : 0);
  return at;
}

Trainer::Trainer(const Flags& f, const Placement& at) : f_(f), at_(at) {
  const Layout layout{at.tp, f.sequence_parallel, f.checkpoint_activations, at.ep, f.cp > 1 ? at.cp : nullptr,
                      f.cp_attention == "ulysses", f.keep_matmul_outputs};
  const bool head = at.last_stage(f);
  stage_ = Stage(f.model, layout,
                 initial_values(f.model, f.seed, at.first_layer, at.last_layer, at.first_stage(), head),
                 at.first_layer, at.last_layer, at.first_stage(), head);
  std::vector<at::Tensor> params;
  if (f.data_parallel == "fsdp") {
    // The experts sharded over the edp ranks that hold the same ones (their
    // gradients averaged there), the rest over all of dp: torchtitan's efsdp.
    dtrain::FSDPOptions::SubmoduleGroups experts_over_edp;
    for (const auto& item : stage_->named_modules("", /*include_self=*/false))
      if (dynamic_cast<dtrain::expert_parallel::GroupedExpertsImpl*>(item.value().get()) != nullptr)
        experts_over_edp[item.key()] = at.edp_cp;
    fsdp_ = std::make_shared<dtrain::FullyShardedDataParallel<StageImpl>>(
        stage_.ptr(), dtrain::FSDPOptions().process_group(at.dp_cp).submodule_groups(experts_over_edp));
    params = fsdp_->parameters();
  } else {
    // The experts are each rank's own: averaged over edp after backward.
    ddp_ = std::make_shared<dtrain::DistributedDataParallel<StageImpl>>(
        stage_.ptr(), dtrain::DDPOptions().process_group(at.dp_cp).params_and_buffers_to_ignore(
                          dtrain::expert_parallel::ignored_by_data_parallel(*stage_)));
    params = stage_->parameters();
  }
  optimizer_ = std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(f.lr).weight_decay(0.1).betas({0.9, 0.95}));
  if (f.sync == "diloco") start_diloco();
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
  // Under CP this rank's head and tail chunks of each sequence, and of
  // its targets.
  const auto part = [&](const at::Tensor& t) {
    return f_.cp > 1 ? dtrain::context_parallel::shard_sequence(t, 1, at_.cp) : t;
  };
  const auto input = part(rows.narrow(1, 0, f_.model.seq)), target = part(rows.narrow(1, 1, f_.model.seq));
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
  average_expert_gradients();
  {
    dtrain::TimelineSpan span("optimizer.step");
    if (diloco_)
      diloco_->step();  // the inner step, then the fragments' syncs due
    else
      optimizer_->step();
  }
  balance_experts();
  return mean.defined() ? mean.detach() : mean;
}

// DiLoCo across the data-parallel ranks: DDP stays (it runs the pipeline
// and checks the replicas alike) but averages nothing; AdamW steps inside
// each replica, an SGD with Nesterov momentum outside; fragments are runs
// of consecutive layers (the embedding with the first, the head with the
// last).
void Trainer::start_diloco() {
  namespace ls = dtrain::local_sgd;
  ddp_->register_comm_hook(ls::post_local_sgd_hook(
      ls::PostLocalSGDState().start_local_sgd_iter(0).post_local_gradient_allreduce(false)));
  const int64_t layers = at_.last_layer - at_.first_layer;
  require(f_.fragments >= 1 && f_.fragments <= layers, "--fragments " + n(f_.fragments) + " must be in 1.." +
                                                           n(layers) + " (the layers of a pipeline stage)");
  std::vector<std::vector<at::Tensor>> fragments(static_cast<size_t>(f_.fragments));
  int64_t current = 0;
  for (const auto& item : stage_->named_parameters()) {
    const std::string& name = item.key();
    if (name.rfind("layers.", 0) == 0)
      current = (std::stoll(name.substr(7)) - at_.first_layer) * f_.fragments / layers;
    fragments[static_cast<size_t>(current)].push_back(item.value());
  }
  outer_ = std::make_unique<torch::optim::SGD>(
      stage_->parameters(),
      torch::optim::SGDOptions(f_.outer_lr).momentum(f_.outer_momentum).nesterov(f_.outer_momentum > 0));
  diloco_ = std::make_unique<ls::DiLoCo>(fragments, *optimizer_, *outer_,
                                         ls::DiLoCoOptions()
                                             .sync_every(f_.sync_every)
                                             .sync_delay(f_.sync_delay)
                                             .fragment_update_alpha(f_.mixing)
                                             .group(at_.dp));
}

// An expert's gradient holds its ep group's tokens (divided by the group's
// size as it arrived): the mean over the edp (and cp) ranks that hold the
// same expert makes it the whole batch's. One all_reduce of them all.
void Trainer::average_expert_gradients() {
  const auto& holders = at_.edp_cp;
  if (fsdp_ || !holders || holders->size() == 1) return;  // (FSDP averages them over edp x cp itself)
  std::vector<at::Tensor> grads, rows;
  for (const auto& moe : stage_->moes())
    for (const auto& p : moe->experts->parameters()) {
      grads.push_back(p.grad());
      rows.push_back(p.grad().reshape(-1));
    }
  if (grads.empty()) return;
  auto flat = torch::cat(rows);
  holders->all_reduce(flat)->wait();
  flat.div_(holders->size());
  int64_t offset = 0;
  for (auto& g : grads) {
    g.copy_(flat.narrow(0, offset, g.numel()).view_as(g));
    offset += g.numel();
  }
}

// The load (tokens per expert, summed over this stage's ranks, relative to
// the mean: under TP without SP each token counts tp times, and twice with
// activation checkpointing's recomputation, which changes no ratio and
// moves no bias) and the bias step of every MoE layer: one all_reduce of
// every layer's counts, which then steer each bias as this rank's own.
void Trainer::balance_experts() {
  const auto moes = stage_->moes();
  if (moes.empty()) return;
  std::vector<at::Tensor> counts;
  for (const auto& moe : moes) counts.push_back(moe->tokens_per_expert);
  auto all = torch::stack(counts);
  at_.stage->all_reduce(all)->wait();
  const auto share = all / all.mean(1, /*keepdim=*/true);
  expert_load_ = {share.min().item<double>(), share.max().item<double>()};
  for (size_t i = 0; i < moes.size(); ++i) {
    auto moe = moes[i];
    {
      torch::NoGradGuard no_grad;
      moe->tokens_per_expert.copy_(all[static_cast<int64_t>(i)]);
    }
    moe->update_expert_bias();  // the stage's counts, summed above
  }
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
  if (diloco_) {
    dtrain::checkpoint::add_optimizer(state, *outer_, *stage_, "outer/");
    dtrain::checkpoint::add_diloco(state, *diloco_);
  }
}

}  // namespace llama
