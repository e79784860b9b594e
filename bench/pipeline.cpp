// dtrain-bench pipeline: the bubble and the memory of the pipeline
// schedules, measured on ranks that are processes with one intra-op thread
// each (one per core here).
//
//   bubble  each rank's idle fraction (1 - time in forwards and backwards /
//           step time, over --steps steps after one warm-up; the same spans
//           DTRAIN_TIMELINE draws per stage; "wait" is the part spent
//           waiting for the other rank), for GPipe, 1F1B and
//           interleaved 1F1B (2 stages per rank) and ZB-V (two half
//           stages per rank, shown against 1F1B's theory, as zero bubble
//           has none) on --ranks ranks with
//           balanced stages (--layers Linear(--width) + tanh per rank,
//           split evenly over its stages), --microbatches of a --batch;
//           each beside its theory, (p-1)/(m+p-1) or (p-1)/(vm+p-1).
//   memory  peak resident memory (VmHWM) of the rank holding stage 0 under
//           GPipe and 1F1B on an activation-heavy model (--mem-blocks
//           blocks of Linear(w, 4w), GELU, Linear(4w, w) per stage;
//           --mem-batch rows, 16 microbatches; one step after a warm-up),
//           as 1F1B's ratio to GPipe's.
//
//   dtrain-bench pipeline [--ranks 2] [--width 256] [--layers 8] [--batch 512]
//                         [--microbatches 8] [--steps 10] [--mem-batch 16384]
//                         [--mem-blocks 4] [--backend auto] [--run bubble,memory]

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "dtrain/dtrain.h"
#include "ranks.h"

namespace dtrain::bench {
namespace {

namespace pp = pipelining;

// One stage: `blocks` blocks of width `width` (`mult` 1: Linear + tanh;
// else Linear(w, mult w), GELU, Linear(mult w, w)).
torch::nn::Sequential make_stage(int blocks, int width, int mult) {
  torch::nn::Sequential s;
  for (int i = 0; i < blocks; ++i) {
    if (mult == 1) {
      s->push_back(torch::nn::Linear(width, width));
      s->push_back(torch::nn::Functional(torch::tanh));
    } else {
      s->push_back(torch::nn::Linear(width, mult * width));
      s->push_back(torch::nn::GELU());
      s->push_back(torch::nn::Linear(mult * width, width));
    }
  }
  return s;
}

// The model and data of bench/scripts/pipeline_vs_pytorch.py, from formulas
// both sides compute alike: 4 x [Linear(16, 16), Tanh], 5 steps of 8 rows.
constexpr int kRefWidth = 16, kRefRows = 8;

torch::nn::Sequential reference_model() {
  torch::NoGradGuard no_grad;
  torch::nn::Sequential m;
  for (int i = 0; i < 4; ++i) {
    torch::nn::Linear l(kRefWidth, kRefWidth);
    l->weight.copy_((torch::arange(kRefWidth * kRefWidth) * 0.37 + i).sin().reshape({kRefWidth, kRefWidth}) * 0.25);
    l->bias.copy_((torch::arange(kRefWidth) * 0.11 + i).cos() * 0.1);
    m->push_back(l);
    m->push_back(torch::nn::Tanh());
  }
  return m;
}

torch::Tensor reference_input(int step) {
  return (torch::arange(kRefRows * kRefWidth) * 0.05 + step).sin().reshape({kRefRows, kRefWidth});
}

torch::Tensor reference_target(int step) {
  return (torch::arange(kRefRows * kRefWidth) * 0.07 + 2 * step).cos().reshape({kRefRows, kRefWidth}) * 0.5;
}

// pp-ref: two stages under --schedule gpipe or 1f1b, 4 microbatches, SGD
// (lr 0.5), 5 steps; each rank writes its stage's parameters, float32 in
// order, to --out with ".<rank>" appended.
int reference_rank_main(const Args& a) {
  init_process_group(InitOptions().backend(a.get("backend", "tcp")));
  const int r = get_rank();
  auto piece = pp::split_sequential(reference_model(), 2)[r];
  pp::PipelineStage stage(piece, r, 2);
  auto mse = [](const at::Tensor& o, const at::Tensor& t) { return torch::mse_loss(o, t); };
  std::unique_ptr<pp::PipelineSchedule> s;
  if (a.get("schedule", "gpipe") == "gpipe") s = std::make_unique<pp::ScheduleGPipe>(stage, 4, mse);
  else s = std::make_unique<pp::Schedule1F1B>(stage, 4, mse);
  torch::optim::SGD opt(piece->parameters(), 0.5);
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    if (r == 0) s->step(reference_input(step));
    else s->step(reference_target(step), nullptr);
    opt.step();
  }
  const std::string path = a.get("out", "pp-ref") + "." + std::to_string(r);
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) throw std::runtime_error("cannot write " + path);
  for (const auto& p : piece->parameters()) {
    auto t = p.detach().contiguous();
    std::fwrite(t.data_ptr<float>(), sizeof(float), t.numel(), f);
  }
  std::fclose(f);
  destroy_process_group();
  return 0;
}

}  // namespace

bool is_pipeline_mode(const std::string& mode) { return mode.rfind("pp-", 0) == 0; }

// Modes: pp-gpipe, pp-1f1b, pp-interleaved, pp-zbv (bubble); pp-mem-gpipe,
// pp-mem-1f1b (memory); pp-ref (against PyTorch, run by
// bench/scripts/pipeline_vs_pytorch.sh).
int pipeline_rank_main(const std::string& mode, const Args& a) {
  if (mode == "pp-ref") return reference_rank_main(a);
  torch::set_num_threads(1);
  init_process_group(InitOptions().backend(a.get("backend", "auto")));
  const int p = get_world_size(), r = get_rank();
  const bool memory = mode.rfind("pp-mem-", 0) == 0;
  const std::string schedule = memory ? mode.substr(7) : mode.substr(3);
  const int v = schedule == "interleaved" || schedule == "zbv" ? 2 : 1;
  const int width = a.num("width", 256), layers = a.num("layers", 8);
  const int m = memory ? 16 : a.num("microbatches", 8);
  const int batch = memory ? a.num("mem-batch", 16384) : a.num("batch", 512);
  const int steps = memory ? 1 : a.num("steps", 10);
  torch::manual_seed(r);
  std::vector<pp::PipelineStage> stages;
  std::vector<torch::Tensor> params;
  for (int k = 0; k < v; ++k) {
    auto piece = make_stage(memory ? a.num("mem-blocks", 4) : layers / v, width, memory ? 4 : 1);
    for (auto& t : piece->parameters()) params.push_back(t);
    // Looped (stage r + kp), or for ZB-V a V (stages r and 2p - 1 - r).
    const int index = schedule == "zbv" && k == 1 ? 2 * p - 1 - r : r + k * p;
    stages.emplace_back(piece, index, p * v);
  }
  auto mse = [](const at::Tensor& o, const at::Tensor& t) { return torch::mse_loss(o, t); };
  std::unique_ptr<pp::PipelineSchedule> s;
  if (schedule == "gpipe") s = std::make_unique<pp::ScheduleGPipe>(stages[0], m, mse);
  else if (schedule == "1f1b") s = std::make_unique<pp::Schedule1F1B>(stages[0], m, mse);
  else if (schedule == "zbv") s = std::make_unique<pp::ScheduleZBVZeroBubble>(stages, m, mse);
  else s = std::make_unique<pp::ScheduleInterleaved1F1B>(stages, m, mse);
  torch::optim::SGD opt(params, 1e-3);
  const auto x = torch::randn({batch, width}), y = torch::randn({batch, width});
  double compute = 0, total = 0, wait = 0;
  for (int i = 0; i <= steps; ++i) {
    opt.zero_grad();
    if (schedule == "zbv" && r == 0) s->step(x, y, nullptr);  // stages 0 and 2p - 1
    else if (schedule == "zbv") s->step();
    else if (r == 0) s->step(x);
    else if (r == p - 1) s->step(y, nullptr);
    else s->step();
    opt.step();
    if (i == 0) continue;  // warm-up
    compute += s->stats().compute_ms;
    wait += s->stats().wait_ms;
    total += s->stats().step_ms;
  }
  auto idle = at::zeros({3, p}, at::kDouble);
  idle[0][r] = 1 - compute / total;
  idle[1][r] = wait / total;
  idle[2][r] = compute / steps;
  all_reduce(idle);
  if (r == 0) {
    std::printf("result peak_rss=%lld samples_per_s=%.2f",
                static_cast<long long>(vm_status_bytes("VmHWM:")),
                steps * batch / (total / 1000));
    for (int q = 0; q < p; ++q)
      std::printf(" idle%d=%.4f wait%d=%.4f compute%d=%.2f", q, idle[0][q].item<double>(), q,
                  idle[1][q].item<double>(), q, idle[2][q].item<double>());
    std::printf("\n");
  }
  destroy_process_group();
  return 0;
}

int bench_pipeline(const Args& a) {
  const int p = a.num("ranks", 2), m = a.num("microbatches", 8);
  Args rank_args;
  for (const char* k :
       {"width", "layers", "batch", "microbatches", "steps", "mem-batch", "mem-blocks", "backend"})
    if (a.flags.count(k)) rank_args.flags[k] = a.get(k, "");
  std::printf("bubble: %d ranks, one intra-op thread each, %d microbatches of a batch of %s, "
              "%s x Linear(%s) + tanh per rank\n",
              p, m, a.get("batch", "512").c_str(), a.get("layers", "8").c_str(),
              a.get("width", "256").c_str());
  std::printf("%-13s %8s", "schedule", "theory");
  for (int q = 0; q < p; ++q) std::printf("   idle%d  xtheory  wait%d", q, q);
  std::printf(" %10s\n", "samples/s");
  const std::string parts = a.get("run", "bubble,memory");
  for (const char* schedule : {"gpipe", "1f1b", "interleaved", "zbv"}) {
    if (parts.find("bubble") == std::string::npos) break;
    const int v = std::string(schedule) == "interleaved" ? 2 : 1;
    // ZB-V's theory is no bubble at all: it is shown against 1F1B's.
    const bool zbv = std::string(schedule) == "zbv";
    if (zbv && m < 2 * p) {
      std::printf("%-13s skipped: ScheduleZBVZeroBubble needs at least 2 x %d ranks microbatches "
                  "(--microbatches %d)\n", schedule, p, 2 * p);
      continue;
    }
    const double theory = (p - 1.0) / ((zbv ? 1 : v) * m + p - 1.0);
    const auto out = run_ranks(p, std::string("pp-") + schedule, rank_args);
    std::printf("%-13s %8.4f", schedule, theory);
    for (int q = 0; q < p; ++q) {
      const double idle = field(out, "idle" + std::to_string(q));
      std::printf("  %6.4f %8.3f %6.4f", idle, idle / theory,
                  field(out, "wait" + std::to_string(q)));
    }
    std::printf(" %10.1f\n", field(out, "samples_per_s"));
    std::fflush(stdout);
  }
  if (parts.find("memory") == std::string::npos) return 0;
  double rss[2];
  int i = 0;
  for (const char* schedule : {"gpipe", "1f1b"})
    rss[i++] = field(run_ranks(p, std::string("pp-mem-") + schedule, rank_args), "peak_rss");
  std::printf("memory: peak RSS of stage 0, 16 microbatches of %s rows, %s x [Linear(%s, 4x), "
              "GELU, Linear(4x, %s)] per stage: GPipe %.1f MiB, 1F1B %.1f MiB, 1F1B / GPipe "
              "%.3f\n",
              a.get("mem-batch", "16384").c_str(), a.get("mem-blocks", "4").c_str(),
              a.get("width", "256").c_str(),
              a.get("width", "256").c_str(), rss[0] / (1 << 20), rss[1] / (1 << 20),
              rss[1] / rss[0]);
  return 0;
}

}  // namespace dtrain::bench
