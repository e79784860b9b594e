#pragma once

// dtrain-llama's job: the flags, and this rank's place in the layout
// (pipeline stage x data-parallel replica x tensor-parallel rank) with its
// part of the model, its optimizer and its checkpoint (train.cpp,
// layout.cpp, checkpoint.cpp).

#include <dtrain/dtrain.h>
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "model.h"

namespace llama {

struct Flags {
  int tp = 1, pp = 1, dp = 0;  // dp 0: what the world size leaves
  int ep = 1;                  // expert-parallel ranks, borrowed from dp (with model.experts)
  int cp = 1;                  // context-parallel ranks: each a head-tail part of every sequence
  std::string cp_attention = "ring";  // or "ulysses"
  std::string data_parallel = "ddp";
  // How the replicas meet: ddp (gradients every step, under --data-parallel)
  // or diloco (each replica alone, the replicas' parameters synced every
  // sync_every steps by an outer Nesterov step: local_sgd.h).
  std::string sync = "ddp";
  int64_t sync_every = 32, fragments = 1, sync_delay = 0;
  double mixing = 0, outer_lr = 0.7, outer_momentum = 0.9;
  bool sequence_parallel = false, checkpoint_activations = false, keep_matmul_outputs = false;
  int64_t steps = 200, batch = 16, microbatches = 4;  // batch: sequences per step, all ranks together
  Config model;
  double lr = 2e-3;
  uint64_t seed = 0;
  int threads = 1;
  std::string corpus = "/usr/share/games/fortunes";
  std::string checkpoint_dir = "checkpoints/llama", out_dir;
  std::string import_safetensors, export_safetensors;  // Hugging Face files in (initial weights) and out
  int64_t checkpoint_every = 100, log_every = 10, sample_bytes = 300;
  bool resume = false, print_losses = false;
  std::string backend = "auto";
  int64_t crash_at_step = -1;  // test hook: the last rank SIGKILLs itself there (first attempt)
};

// This rank's part of the layout, built over the default group: the mesh
// (pp, dp, cp, tp). The data-parallel ranks of a stage split into ep
// groups of consecutive ranks (each holding every expert once) and edp
// groups (the ranks holding the same experts); `stage` is every rank of
// this pipeline stage (dp x cp x tp).
struct Placement {
  int pp_rank = 0, dp_rank = 0, tp_rank = 0;
  std::shared_ptr<dtrain::ProcessGroup> pp, dp, tp, ep, edp, stage;
  // The context-parallel ranks (parts of the same sequences), the ranks
  // whose gradients are averaged (dp x cp; dp without CP), and those
  // holding the same experts (edp x cp).
  std::shared_ptr<dtrain::ProcessGroup> cp, dp_cp, edp_cp;
  std::shared_ptr<dtrain::ProcessGroup> replica;  // with --sync diloco: this replica's ranks (pp x tp)
  int64_t first_layer = 0, last_layer = 0;
  bool first_stage() const { return pp_rank == 0; }
  bool last_stage(const Flags& f) const { return pp_rank == f.pp - 1; }
};

// This rank's stage of the model, wrapped for the data-parallel axis, and
// what runs it: one step's forward and backward of this rank's rows.
class Trainer {
 public:
  Trainer(const Flags& f, const Placement& at);
  ~Trainer();
  // Rows [input | target] of this replica ([rows, seq + 1]); returns the
  // mean loss of those rows on the last stage (undefined elsewhere).
  at::Tensor step(const at::Tensor& rows);
  Stage& stage() { return stage_; }
  torch::optim::AdamW& optimizer() { return *optimizer_; }
  // Its share of a checkpoint: each parameter and its AdamW state
  // ("model/param/<name>", "model/optim/<name>/<field>"), as boxes of the
  // whole layers, under DDP or FSDP alike, so it resumes in any layout;
  // with --sync diloco also the outer optimizer ("outer/") and DiLoCo's
  // state (its replica's checkpoint: Placement::replica).
  void add_to(dtrain::checkpoint::DistributedState& state);
  // The parameters alone, by their names (safetensors in and out).
  void add_weights_to(dtrain::checkpoint::DistributedState& state);
  // With experts: the fewest and most tokens any expert of this stage's
  // layers took in the last step (all its data-parallel ranks' tokens), as
  // fractions of its layer's mean (1, 1: perfect balance); {0, 0} without.
  std::pair<double, double> expert_load() const { return expert_load_; }

 private:
  const Flags& f_;
  const Placement& at_;
  Stage stage_{nullptr};
  std::shared_ptr<dtrain::DistributedDataParallel<StageImpl>> ddp_;
  std::shared_ptr<dtrain::FullyShardedDataParallel<StageImpl>> fsdp_;
  std::unique_ptr<dtrain::pipelining::PipelineStage> pipeline_;
  std::unique_ptr<dtrain::pipelining::PipelineSchedule> schedule_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::unique_ptr<torch::optim::SGD> outer_;             // with --sync diloco
  std::unique_ptr<dtrain::local_sgd::DiLoCo> diloco_;  // (the inner optimizer is optimizer_)
  std::pair<double, double> expert_load_{0, 0};
  void average_expert_gradients();
  void start_diloco();
  void balance_experts();
};

// The mesh (pp, dp, cp, tp) over the default group; checks the sizes.
Placement place(Flags& f);

// A line describing the model, kept in checkpoints to refuse another one.
std::string describe(const Config& c);

// Rank 0 only (after the final checkpoint): the whole model loaded from
// `dir` in this process, continuing `prompt` by `bytes` sampled bytes.
// `solo` is a group of rank 0 alone.
std::string sample(const Flags& f, const std::shared_ptr<dtrain::ProcessGroup>& solo,
                   const std::string& prompt);

}  // namespace llama
