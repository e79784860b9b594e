// dtrain-llama: a small Llama-style decoder trained on the fortunes Debian
// ships, byte by byte, in any 3-D layout of the ranks dtrain-run starts:
//
//   dtrain-run --standalone --nproc-per-node 8 dtrain-llama --tp 2 --pp 2 --dp 2
//
// --experts E makes each layer's feed-forward a mixture of E experts (top
// --top-k per token), split over --ep of the data-parallel ranks. --cp
// splits every sequence over context-parallel ranks (ring attention, or
// Ulysses with --cp-attention ulysses).
// --tp splits each layer's matrices (and the vocabulary) over tensor-parallel
// ranks (with --sequence-parallel, the activations between them too), --pp
// cuts the layers into pipeline stages (1F1B over --microbatches), --dp
// replicates that over data-parallel ranks with DDP or FSDP
// (--data-parallel). Every layout of the same --batch trains on the same
// sequences from the same initial values, so its losses are the same up to
// rounding. Rank 0 shows progress and writes metrics.jsonl and loss.png;
// every rank writes its share of a distributed checkpoint, so a killed run
// resumes exactly (--resume, or by itself after a dtrain-run restart), in
// any layout; at the end rank 0 loads the checkpoint whole and writes a
// sample of text. examples/llama/README section: README.md.

#include <CLI/CLI.hpp>
#include <sys/stat.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>

#include "../fashion_mnist/report.h"
#include "corpus.h"
#include "job.h"

namespace {

using llama::Flags;

Flags parse(int argc, char** argv) {
  CLI::App app{"A Llama-style decoder trained on Debian's fortunes in 3-D parallelism (run it under dtrain-run)"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // the last one given wins
  Flags f;
  auto positive = CLI::PositiveNumber;
  app.add_option("--tp", f.tp, "Tensor-parallel ranks per layer")->capture_default_str()->check(positive);
  app.add_option("--pp", f.pp, "Pipeline stages")->capture_default_str()->check(positive);
  app.add_option("--dp", f.dp, "Data-parallel replicas (0: the ranks / (tp x pp))")->capture_default_str();
  app.add_option("--data-parallel", f.data_parallel, "How replicas share gradients: ddp, or fsdp (sharded)")
      ->capture_default_str()->check(CLI::IsMember({"ddp", "fsdp"}));
  app.add_option("--sync", f.sync, "How the data-parallel replicas meet: ddp (gradients every step) or diloco "
                 "(alone for --sync-every steps, then an outer step on their averaged parameter change)")
      ->capture_default_str()->check(CLI::IsMember({"ddp", "diloco"}));
  app.add_option("--sync-every", f.sync_every, "DiLoCo: inner steps between syncs (H)")->capture_default_str()->check(positive);
  app.add_option("--fragments", f.fragments, "Streaming DiLoCo: runs of layers synced at staggered steps")
      ->capture_default_str()->check(positive);
  app.add_option("--sync-delay", f.sync_delay, "Streaming DiLoCo: steps a fragment's average runs in the background")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--mixing", f.mixing, "Streaming DiLoCo: the share of a replica's own values kept at a sync")
      ->capture_default_str()->check(CLI::Range(0.0, 1.0));
  app.add_option("--outer-lr", f.outer_lr, "DiLoCo: the outer SGD's learning rate")->capture_default_str()->check(positive);
  app.add_option("--outer-momentum", f.outer_momentum, "DiLoCo: the outer SGD's Nesterov momentum (0: none)")
      ->capture_default_str()->check(CLI::Range(0.0, 1.0));
  app.add_flag("--sequence-parallel", f.sequence_parallel, "Split the activations between TP layers along the sequence");
  app.add_flag("--checkpoint-activations", f.checkpoint_activations, "Recompute each layer's activations in the backward");
  app.add_flag("--keep-matmul-outputs", f.keep_matmul_outputs,
               "With --checkpoint-activations: keep the matrix multiplies' outputs, recompute the rest (selective)")
      ->needs("--checkpoint-activations");
  app.add_option("--steps", f.steps, "Optimizer steps")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--batch", f.batch, "Sequences per step, all ranks together")->capture_default_str()->check(positive);
  app.add_option("--microbatches", f.microbatches, "Microbatches per step with --pp > 1")->capture_default_str()->check(positive);
  app.add_option("--seq", f.model.seq, "Tokens (bytes) per sequence")->capture_default_str()->check(positive);
  app.add_option("--dim", f.model.dim, "Model width")->capture_default_str()->check(positive);
  app.add_option("--layers", f.model.layers, "Decoder layers")->capture_default_str()->check(positive);
  app.add_option("--heads", f.model.heads, "Attention heads")->capture_default_str()->check(positive);
  app.add_option("--hidden", f.model.hidden, "The feed-forward's inner width")->capture_default_str()->check(positive);
  app.add_option("--experts", f.model.experts, "Mixture of experts: SwiGLU experts per layer (0: a dense feed-forward)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--top-k", f.model.top_k, "Experts per token")->capture_default_str()->check(positive);
  app.add_option("--balance-rate", f.model.balance_rate,
                 "How far each step moves an expert's routing bias towards balance (0: no balancing)")
      ->capture_default_str()->check(CLI::Range(0.0, 1.0));
  app.add_flag("--shared-expert", f.model.shared_expert, "A shared expert every token goes through, beside the routed ones");
  app.add_option("--ep", f.ep, "Expert-parallel ranks (taken from the data-parallel ones)")->capture_default_str()
      ->check(positive);
  app.add_option("--cp", f.cp, "Context-parallel ranks: each holds an early and a late part of every sequence")
      ->capture_default_str()->check(positive);
  app.add_option("--cp-attention", f.cp_attention, "Attention over the context-parallel ranks: ring or ulysses")
      ->capture_default_str()->check(CLI::IsMember({"ring", "ulysses"}));
  app.add_option("--dropout", f.model.dropout, "Dropout on attention and residual branches")->capture_default_str()
      ->check(CLI::Range(0.0, 0.9));
  app.add_option("--lr", f.lr, "AdamW's learning rate")->capture_default_str()->check(positive);
  app.add_option("--seed", f.seed, "Seed of the initial values, the batches and dropout")->capture_default_str();
  app.add_option("--threads", f.threads, "Intra-op threads per rank")->capture_default_str()->check(positive);
  app.add_option("--corpus", f.corpus, "A directory of text files")->capture_default_str();
  app.add_option("--checkpoint-dir", f.checkpoint_dir, "The distributed checkpoint (every rank must see it)")->capture_default_str();
  app.add_option("--checkpoint-every", f.checkpoint_every, "Checkpoint every N steps (0: at the end only)")->capture_default_str();
  app.add_option("--out-dir", f.out_dir, "Where metrics.jsonl and loss.png go (default: runs/llama-<date-time>)");
  app.add_option("--log-every", f.log_every, "Steps per metrics line")->capture_default_str()->check(positive);
  app.add_option("--sample-bytes", f.sample_bytes, "Bytes of sample text at the end (0: none)")->capture_default_str();
  app.add_flag("--resume", f.resume, "Resume from --checkpoint-dir (automatic after a dtrain-run restart)");
  app.add_option("--import-safetensors", f.import_safetensors,
                 "Start from the weights in this directory's Hugging Face .safetensors files");
  app.add_option("--export-safetensors", f.export_safetensors,
                 "At the end, write the weights here as Hugging Face safetensors (model.safetensors)");
  app.add_flag("--print-losses", f.print_losses, "Print every step's loss (rank 0)");
  app.add_option("--backend", f.backend, "Process-group backend")->capture_default_str();
  app.add_option("--crash-at-step", f.crash_at_step, "Test hook: the last rank SIGKILLs itself at this step (first attempt only)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  return f;
}

std::string out_dir_of(const Flags& f) {
  if (!f.out_dir.empty()) return f.out_dir;
  char stamp[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", std::localtime(&now));
  return std::string("runs/llama-") + stamp;
}

// The loss of the whole step: the mean of the last stage's replicas' (and
// their context-parallel parts', each as many tokens), on every rank.
double global_loss(const at::Tensor& mine, const llama::Placement& at, const Flags& f) {
  auto t = torch::zeros({1}, torch::kDouble);
  if (mine.defined() && at.tp_rank == 0) t[0] = mine.item<double>() / (f.dp * f.cp);
  dtrain::all_reduce(t);
  return t.item<double>();
}

// mkdir -p of every directory above `path`'s last component.
void make_parents(const std::string& path) {
  for (size_t slash = path.find('/', 1); slash != std::string::npos; slash = path.find('/', slash + 1))
    mkdir(path.substr(0, slash).c_str(), 0755);
}

bool has_checkpoint(const std::string& dir) {
  struct stat st {};
  return stat(dir.c_str(), &st) == 0 && [&] {
    try {
      dtrain::checkpoint::inspect(dir);
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }();
}

// Saves this layout's checkpoint of `step` (collective; with --sync diloco
// over this replica's ranks, into its own directory).
void save(llama::Trainer& trainer, const Flags& f, const llama::Placement& at, int64_t step) {
  dtrain::checkpoint::DistributedState state;
  trainer.add_to(state);
  state.metadata["llama.model"] = llama::describe(f.model);
  state.metadata["llama.step"] = std::to_string(step);
  state.metadata["llama.seed"] = std::to_string(f.seed);
  dtrain::checkpoint::save(f.checkpoint_dir, state, dtrain::checkpoint::SaveOptions().process_group(at.replica));
}

// The step to start from: 0, or the checkpoint's (its model checked).
int64_t resume(llama::Trainer& trainer, const Flags& f, bool leader) {
  if (!f.resume && !(dtrain::restart_count() > 0 && has_checkpoint(f.checkpoint_dir))) return 0;
  const auto info = dtrain::checkpoint::inspect(f.checkpoint_dir);
  const auto get = [&](const std::string& key) {
    const auto found = info.metadata.find(key);
    return found == info.metadata.end() ? std::string("(none)") : found->second;
  };
  if (get("llama.model") != llama::describe(f.model) || get("llama.seed") != std::to_string(f.seed))
    throw dtrain::InvalidArgument("dtrain-llama: " + f.checkpoint_dir + " holds " + get("llama.model") +
                                  ", seed " + get("llama.seed") + "; this run is " +
                                  llama::describe(f.model) + ", seed " + std::to_string(f.seed));
  dtrain::checkpoint::DistributedState state;
  trainer.add_to(state);
  dtrain::checkpoint::load(f.checkpoint_dir, state);
  const int64_t step = std::stoll(get("llama.step"));
  if (leader)
    std::cout << "resumed from " << f.checkpoint_dir << " at step " << step << " (written by "
              << info.world_size << " ranks; restart " << dtrain::restart_count() << ")" << std::endl;
  return step;
}

// The largest peak resident set (VmHWM) of any rank, in MiB (collective).
double largest_peak_rss_mib() {
  std::ifstream status("/proc/self/status");
  double kib = 0;
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) kib = std::stod(line.substr(6));
  auto t = torch::tensor({kib / 1024}, torch::kDouble);
  dtrain::all_reduce(t, dtrain::AllReduceOptions().op(dtrain::ReduceOp::MAX));
  return t.item<double>();
}

void plot(const std::string& dir) {
  const std::string script =
      "set terminal pngcairo size 800,450\nset output 'loss.png'\nset title 'dtrain-llama'\n"
      "set xlabel 'step'\nset ylabel 'loss (nats per byte)'\nset grid\n"
      "plot 'loss.dat' using 1:2 with lines title 'training loss'\n";
  if (!run_gnuplot(script, dir))
    std::cerr << "gnuplot failed (is Debian's gnuplot-nox installed?); no plot; see " << dir << "/gnuplot.log\n";
}

}  // namespace

int main(int argc, char** argv) {
  Flags f = parse(argc, argv);
  try {
    dtrain::init_process_group(dtrain::InitOptions().backend(f.backend));
    torch::set_num_threads(f.threads);
    const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
    const bool leader = rank == 0;
    const llama::Corpus corpus(f.corpus);
    const llama::Placement at = llama::place(f);
    llama::Trainer trainer(f, at);
    if (!f.import_safetensors.empty()) {
      dtrain::checkpoint::DistributedState weights;
      trainer.add_weights_to(weights);
      dtrain::checkpoint::import_safetensors(f.import_safetensors, weights);
      if (leader) std::cout << "weights from " << f.import_safetensors << std::endl;
    }
    const int64_t first = resume(trainer, f, leader);
    const std::string out = out_dir_of(f);
    if (leader) {
      make_parents(out + "/");
      make_parents(f.checkpoint_dir);  // save() makes the directory itself
      std::cout << "dtrain-llama: " << llama::describe(f.model) << "; " << corpus.size() << " bytes of text from "
                << corpus.files() << " files; " << world << " ranks: tp " << f.tp << " x pp " << f.pp
                << (f.cp > 1 ? " x cp " + std::to_string(f.cp) + " (" + f.cp_attention + ")" : "") << " x dp "
                << f.dp << " (" << (f.sync == "diloco" ? "diloco, sync every " + std::to_string(f.sync_every) : f.data_parallel) << ")" << (f.sequence_parallel ? ", sequence parallel" : "")
                << (f.checkpoint_activations ? ", activation checkpointing" : "")
                << (f.model.experts > 0 ? ", experts over ep " + std::to_string(f.ep) : "") << "; batch " << f.batch
                << " x " << f.model.seq << " tokens" << std::endl;
    }
    const bool first_attempt = !f.resume && dtrain::restart_count() == 0;
    const int64_t tokens_per_step = f.batch * f.model.seq;
    Progress progress(leader && dtrain::console_is_terminal(), 1, f.steps, tokens_per_step, "tokens");
    progress.start_epoch(0, first);
    std::ofstream metrics, curve;
    if (leader) {
      metrics.open(out + "/metrics.jsonl", std::ios::app);
      curve.open(out + "/loss.dat", std::ios::app);
    }
    const auto run_start = std::chrono::steady_clock::now();
    auto window_start = run_start;
    double window_loss = 0;
    for (int64_t step = first; step < f.steps; ++step) {
      // Dropout: every step's masks from (seed, step, stage), so resuming needs no generator state.
      dtrain::tensor_parallel::manual_seed(f.seed * 1000003 + 101 * static_cast<uint64_t>(step + 1) +
                                               static_cast<uint64_t>(at.pp_rank), at.tp);
      const auto rows = corpus.batch(f.seed, step, f.batch, f.model.seq).chunk(f.dp)[at.dp_rank];
      const double loss = global_loss(trainer.step(rows), at, f);
      if (first_attempt && step + 1 == f.crash_at_step && rank == world - 1) raise(SIGKILL);
      window_loss += loss;
      if (leader) {
        if (f.print_losses) std::printf("step %lld loss %.9g\n", static_cast<long long>(step + 1), loss);
        if (f.model.experts > 0 && ((step + 1) % f.log_every == 0 || step + 1 == f.steps))
          std::printf("step %lld expert load: min %.2f, max %.2f of the mean (stage 0's layers)\n",
                      static_cast<long long>(step + 1), trainer.expert_load().first, trainer.expert_load().second);
        progress.update(step + 1, loss);
        curve << step + 1 << " " << loss << "\n";
      }
      if ((step + 1) % f.log_every == 0 || step + 1 == f.steps) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - window_start).count();
        const int64_t steps = (step + 1 - first) % f.log_every == 0 ? f.log_every : (step + 1 - first) % f.log_every;
        if (leader) {
          metrics << "{\"step\": " << step + 1 << ", \"loss\": " << window_loss / steps
                  << ", \"tokens_per_s\": " << steps * tokens_per_step / s;
          if (f.model.experts > 0)  // rank 0's stage, the last step
            metrics << ", \"expert_load_min\": " << trainer.expert_load().first
                    << ", \"expert_load_max\": " << trainer.expert_load().second;
          metrics << "}" << std::endl;
        }
        window_loss = 0;
        window_start = std::chrono::steady_clock::now();
      }
      if (f.checkpoint_every > 0 && (step + 1) % f.checkpoint_every == 0 && step + 1 < f.steps)
        save(trainer, f, at, step + 1);
    }
    progress.finish_epoch();
    save(trainer, f, at, f.steps);
    if (!f.export_safetensors.empty()) {
      dtrain::checkpoint::DistributedState weights;
      trainer.add_weights_to(weights);
      dtrain::checkpoint::export_safetensors(f.export_safetensors, weights);
      if (leader) std::cout << "weights written to " << f.export_safetensors << "/ as safetensors" << std::endl;
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    const double peak_mib = largest_peak_rss_mib();
    const auto solo = dtrain::new_group({0});
    if (leader) {
      curve.close();
      if (f.steps > first) plot(out);
      std::printf("done: %lld steps, %.0f tokens/s, peak RSS %.0f MiB on the largest rank; metrics %s/metrics.jsonl, "
                  "plot %s/loss.png\n", static_cast<long long>(f.steps),
                  static_cast<double>((f.steps - first) * tokens_per_step) / seconds, peak_mib, out.c_str(), out.c_str());
      std::fflush(stdout);
      if (f.sample_bytes > 0)
        std::cout << "sample:\n" << llama::printable(llama::sample(f, solo, "The ")) << std::endl;
    }
    dtrain::destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    const std::string what = e.what();  // (the layout's errors already say whose they are)
    std::cerr << (what.rfind("dtrain-llama: ", 0) == 0 ? "" : "dtrain-llama: ") << what << std::endl;
    dtrain::record_error(e);
    return 1;
  }
}
