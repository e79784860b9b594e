// dtrain-bench tp: what tensor parallelism saves per rank, and what
// activation checkpointing saves and costs, each beside its baseline run
// in the same invocation.
//
//   memory  per-rank bytes kept between steps (parameters, gradients and
//           Adam's two moments) of --blocks pre-norm MLP blocks
//           (LayerNorm(w), ColumnParallelLinear(w, 4w), GELU,
//           RowParallelLinear(4w, w)) at TP 2 and 4 (ranks are processes),
//           as a ratio to the same blocks unsharded in one process.
//   ac      one process, one intra-op thread: the blocks at --seq tokens
//           (--batch sequences) without activation checkpointing, with it
//           around each block, with a selective one there (keeping both
//           multiplies' outputs), and mixed (selective but for the first
//           --full-blocks, checkpointed whole); activation peak (peak RSS in a step minus
//           the RSS before it, with large blocks returned to the kernel
//           when freed) and median step time over --steps (without), in
//           --runs alternating processes of each, as ratios to no AC.
//
//   speed   the Llama example's model (examples/llama, its default size)
//           at TP 2 over auto (a process per rank, one thread each)
//           against one process with 2 intra-op threads: tokens/s of
//           training steps at --batch 16 x --seq 64 (pass them with
//           --run speed; memory and ac take their own).
//
//   dtrain-bench tp [--width 512] [--blocks 8] [--seq 2048] [--batch 1]
//                   [--steps 4] [--runs 3] [--full-blocks 2] [--run memory,ac,speed]

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "dtrain/dtrain.h"
#include "model.h"
#include "ranks.h"

namespace dtrain::bench {
namespace {

namespace tp = tensor_parallel;

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t width, const std::shared_ptr<ProcessGroup>& group)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))) {
    if (group) {
      const auto options = tp::ParallelLinearOptions().group(group);
      col = register_module("up", tp::ColumnParallelLinear(width, 4 * width, options));
      row = register_module("down", tp::RowParallelLinear(4 * width, width, options));
    } else {
      up = register_module("up", torch::nn::Linear(width, 4 * width));
      down = register_module("down", torch::nn::Linear(4 * width, width));
    }
  }
  // dtrain::linear (linear computed as dtrain computes it) so that a
  // selective checkpoint sees the multiplies.
  at::Tensor forward(at::Tensor x) {
    auto h = norm(x);
    h = col ? col(h) : dtrain::linear(h, up->weight, up->bias);
    h = torch::gelu(h);
    return x + (row ? row(h) : dtrain::linear(h, down->weight, down->bias));
  }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up{nullptr}, down{nullptr};
  tp::ColumnParallelLinear col{nullptr};
  tp::RowParallelLinear row{nullptr};
};
TORCH_MODULE(Block);

std::vector<Block> make_blocks(const Args& a, const std::shared_ptr<ProcessGroup>& group) {
  std::vector<Block> blocks;
  for (int i = 0; i < a.num("blocks", 8); ++i) blocks.emplace_back(a.num("width", 512), group);
  return blocks;
}

std::vector<at::Tensor> parameters_of(const std::vector<Block>& blocks) {
  std::vector<at::Tensor> all;
  for (const auto& b : blocks)
    for (const auto& p : b->parameters()) all.push_back(p);
  return all;
}

// tp-memory: one Adam step, then the bytes of the parameters, their
// gradients and Adam's state on this rank (world 1: unsharded).
int memory_rank(const Args& a) {
  init_process_group(InitOptions().backend("tcp"));
  auto group = get_world_size() > 1 ? default_group() : nullptr;
  auto blocks = make_blocks(a, group);
  const auto params = parameters_of(blocks);
  torch::optim::Adam adam(params, torch::optim::AdamOptions(1e-3));
  auto x = torch::randn({1, 8, a.num("width", 512)});
  for (auto& b : blocks) x = b->forward(x);
  x.pow(2).mean().backward();
  adam.step();
  int64_t bytes = 0;
  for (const auto& p : params) bytes += 2 * p.nbytes();  // the parameter and its gradient
  for (const auto& item : adam.state()) {
    auto& s = static_cast<torch::optim::AdamParamState&>(*item.second);
    bytes += s.exp_avg().nbytes() + s.exp_avg_sq().nbytes();
  }
  std::printf("result bytes=%lld\n", static_cast<long long>(bytes));
  destroy_process_group();
  return 0;
}

// tp-ac: --steps steps of the blocks, each block a checkpointed segment
// with --checkpoint 1, a selective one keeping both multiplies' outputs
// with --checkpoint 2, and with --checkpoint 3 selective but for the first
// --full-blocks (2), checkpointed whole; prints the activation peak and the
// median step.
int ac_rank(const Args& a) {
  torch::set_num_threads(1);
  const int mode = a.num("checkpoint", 0);
  const int full_blocks = mode == 3 ? a.num("full-blocks", 2) : mode == 1 ? a.num("blocks", 8) : 0;
  const auto selective = ActivationCheckpointOptions().policy(keep_matmul_outputs());
  auto blocks = make_blocks(a, nullptr);
  torch::optim::Adam adam(parameters_of(blocks), torch::optim::AdamOptions(1e-3));
  const auto x = torch::randn({a.num("batch", 1), a.num("seq", 2048), a.num("width", 512)});
  auto step = [&] {
    adam.zero_grad();
    at::Tensor h = x;
    for (size_t i = 0; i < blocks.size(); ++i) {
      auto run = [b = blocks[i]](at::Tensor in) mutable { return b->forward(in); };
      if (mode == 0) h = run(h);
      else h = activation_checkpoint(run, h, static_cast<int>(i) < full_blocks ? ActivationCheckpointOptions() : selective);
    }
    h.pow(2).mean().backward();
    adam.step();
  };
  step();  // Adam's state and the gradients exist from here on
  { std::ofstream("/proc/self/clear_refs") << "5"; }  // VmHWM := VmRSS
  const int64_t resting = vm_status_bytes("VmRSS:");
  std::vector<double> ms;
  for (int i = 0; i < a.num("steps", 4); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("result activations=%lld step_ms=%.2f\n",
              static_cast<long long>(vm_status_bytes("VmHWM:") - resting), median(ms));
  return 0;
}

// tp-speed: the Llama example's model (its default size) at --batch x
// --seq tokens, tensor-parallel over the world (world 1: whole, on
// --threads intra-op threads): median tokens/s of --steps training steps
// (AdamW) after one.
int speed_rank(const Args& a) {
  init_process_group(InitOptions().backend("auto"));
  torch::set_num_threads(a.num("threads", 1));
  llama::Config c;
  c.seq = a.num("seq", 64);
  const auto g = default_group();
  llama::Stage model(c, llama::Layout::over(g), llama::initial_values(c, 0, 0, c.layers, true, true),
                     0, c.layers, true, true);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto gen = at::detail::createCPUGenerator(5);
  const auto rows = at::randint(c.vocab, {a.num("batch", 16), c.seq + 1}, gen, torch::kLong);
  auto step = [&] {
    opt.zero_grad();
    llama::loss(model(rows.narrow(1, 0, c.seq)), rows.narrow(1, 1, c.seq), g).backward();
    opt.step();
  };
  step();
  std::vector<double> seconds;
  for (int i = 0; i < a.num("steps", 4); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("result tokens_per_s=%.1f\n", static_cast<double>(rows.size(0) * c.seq) / median(seconds));
  destroy_process_group();
  return 0;
}

void report_speed(const Args& a) {
  std::vector<double> one, two;
  for (int run = 0; run < a.num("runs", 3); ++run) {  // alternating, so that drift hits both
    Args args = a;
    args.flags["threads"] = "2";
    one.push_back(field(run_ranks(1, "tp-speed", args), "tokens_per_s"));
    args.flags["threads"] = "1";
    two.push_back(field(run_ranks(2, "tp-speed", args), "tokens_per_s"));
  }
  std::printf("speed: the Llama example's model (0.9 M parameters), %d x %d tokens a step, AdamW, medians "
              "of %d runs\n", a.num("batch", 16), a.num("seq", 64), a.num("runs", 3));
  std::printf("  one process, 2 intra-op threads: %8.0f tokens/s\n", median(one));
  std::printf("  TP 2 (auto), 1 thread per rank:  %8.0f tokens/s, %.3fx\n", median(two), median(two) / median(one));
}

void report_memory(const Args& a) {
  const double whole = field(run_ranks(1, "tp-memory", a), "bytes");
  std::printf("memory: %d blocks of width %d, parameters + gradients + Adam per rank, against one "
              "process unsharded (%.1f MiB)\n", a.num("blocks", 8), a.num("width", 512), whole / (1 << 20));
  for (int t : {2, 4}) {
    const double mine = field(run_ranks(t, "tp-memory", a), "bytes");
    std::printf("  TP %d: %8.1f MiB per rank, %.3fx\n", t, mine / (1 << 20), mine / whole);
  }
}

// The activations are measured with malloc returning every block of 64
// KiB or more to the kernel when freed (else RSS keeps what a step freed
// and the next step's peak looks like no growth); the step times without
// that, since it makes every large tensor fault its pages in afresh.
void report_ac(const Args& a) {
  const char* names[] = {"no AC", "AC", "selective", "mixed"};
  std::vector<double> act[4], ms[4];
  for (int run = 0; run < a.num("runs", 3); ++run)
    for (int c : {0, 1, 2, 3}) {  // alternating, so that drift hits all four
      Args args = a;
      args.flags["checkpoint"] = std::to_string(c);
      ms[c].push_back(field(run_ranks(1, "tp-ac", args), "step_ms"));
      args.flags["steps"] = "1";  // the peak is the same each step
      act[c].push_back(field(run_ranks(1, "tp-ac", args, nullptr, "MALLOC_MMAP_THRESHOLD_=65536"), "activations"));
    }
  std::printf("activation checkpointing: %d blocks of width %d, %d x %d tokens, one thread, medians of %d "
              "runs\n", a.num("blocks", 8), a.num("width", 512), a.num("batch", 1), a.num("seq", 2048),
              a.num("runs", 3));
  std::printf("  %-10s %14s %10s %12s %6s\n", "", "activations", "step", "activations", "step");
  for (int c : {0, 1, 2, 3})
    std::printf("  %-10s %10.1f MiB %8.1f ms %11.3fx %5.3fx\n", names[c], median(act[c]) / (1 << 20),
                median(ms[c]), median(act[c]) / median(act[0]), median(ms[c]) / median(ms[0]));
  std::printf("  AC: every block checkpointed whole (theory: one more forward, 4/3 = 1.333x step time)\n"
              "  selective: every block keeping both multiplies' outputs (keep_matmul_outputs)\n"
              "  mixed: selective, but the first %d blocks checkpointed whole (--full-blocks)\n",
              a.num("full-blocks", 2));
}

}  // namespace

bool is_tp_mode(const std::string& mode) {
  return mode == "tp-memory" || mode == "tp-ac" || mode == "tp-ref" || mode == "tp-speed" || mode == "moe-ref" ||
         mode == "context-ref";
}

// tp-ref: against PyTorch (tensor_parallel_ref.cpp, bench/scripts/tp_vs_pytorch.sh).
int tp_rank_main(const std::string& mode, const Args& a) {
  if (mode == "tp-ref") return tp_reference_rank_main(a);
  if (mode == "moe-ref") return moe_reference_rank_main(a);  // moe_ref.cpp, bench/scripts/moe_vs_pytorch.sh
  if (mode == "context-ref") return cp_reference_rank_main(a);    // cp_ref.cpp, bench/scripts/cp_vs_pytorch.sh
  if (mode == "tp-speed") return speed_rank(a);
  return mode == "tp-memory" ? memory_rank(a) : ac_rank(a);
}

int bench_tp(const Args& a) {
  std::printf("%s\n", build_line().c_str());
  const std::string run = a.get("run", "memory,ac,speed");
  if (run.find("memory") != std::string::npos) report_memory(a);
  if (run.find("ac") != std::string::npos) report_ac(a);
  if (run.find("speed") != std::string::npos) report_speed(a);
  return 0;
}

}  // namespace dtrain::bench
