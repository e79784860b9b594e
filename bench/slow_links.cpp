// dtrain-bench slow-links: DDP against DiLoCo and Streaming DiLoCo where
// the network is slow (docs/slow-links.md). Two ranks, one intra-op thread
// each, train a residual MLP of about 12.7 M parameters (--width 1024,
// --blocks 12) with AdamW on a task with a known answer: inputs from a
// formula of (rank, step), labels from a fixed random "teacher" network,
// --batch rows per rank and step. Three ways:
//
//   ddp        DDP: gradients averaged every step
//   diloco     DiLoCo: AdamW inside, the replicas meet every --sync-every
//              (H) steps; SGD (0.7, Nesterov 0.9) on the averaged
//              pseudo-gradient outside
//   streaming  Streaming DiLoCo: the same in --fragments runs of blocks,
//              synced at staggered steps, each average in flight for
//              --sync-delay steps
//
// Two parts, each side by side for the three:
//
//  1. Speed on a slow link: the ranks on two "hosts" (network namespaces)
//     joined by a veth whose both ends are shaped to --link-rate (tc tbf;
//     needs root). samples/s (both ranks' rows) over --ddp-steps steps of
//     DDP after one warm-up, and over 2 H steps of the others (every
//     fragment synced twice, the last averages waited for); the bytes that
//     crossed the link; DiLoCo's peak bytes sent in one sync.
//  2. Loss at equal samples, on loopback (the numbers do not depend on the
//     link): --curve-steps steps of each, the evaluation loss (cross
//     entropy on 2048 held-out rows) every H steps, of replica 0's model
//     (DiLoCo's there is the global model, just synced; Streaming's has
//     fragments synced up to H steps before, trained on since).
//     --csv PATH writes the curves (bench/scripts/plot_loss_curves.py draws
//     them). Printed: each evaluation and the mean of the last 4 (one
//     evaluation is noisy).
//
//   dtrain-bench slow-links [--link-rate 100mbit] [--width 1024] [--blocks 12]
//                           [--batch 32] [--sync-every 32] [--fragments 4]
//                           [--sync-delay 4] [--lr 1e-3] [--ddp-steps 4]
//                           [--curve-steps 512] [--csv PATH] [--run speed,loss]

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/dtrain.h"
#include "dtrain/local_sgd.h"
#include "ranks.h"

namespace dtrain::bench {
namespace slow_links {  // (named: dtrain-bench is a unity build)

using Clock = std::chrono::steady_clock;
constexpr int kInputs = 32, kClasses = 10, kEvalRows = 2048;

// in -> width, `blocks` x (x + Linear(GELU(LayerNorm(x)))), LayerNorm -> classes.
struct ResMlpImpl : torch::nn::Module {
  ResMlpImpl(int width, int blocks) {
    in = register_module("in", torch::nn::Linear(kInputs, width));
    for (int i = 0; i < blocks; ++i) {
      norms.push_back(register_module("norm" + std::to_string(i),
                                      torch::nn::LayerNorm(torch::nn::LayerNormOptions({width}))));
      layers.push_back(register_module("layer" + std::to_string(i), torch::nn::Linear(width, width)));
    }
    final_norm = register_module("final_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    out = register_module("out", torch::nn::Linear(width, kClasses));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = in(x);
    for (size_t i = 0; i < layers.size(); ++i) x = x + layers[i](torch::gelu(norms[i](x)));
    return out(final_norm(x));
  }
  torch::nn::Linear in{nullptr}, out{nullptr};
  torch::nn::LayerNorm final_norm{nullptr};
  std::vector<torch::nn::LayerNorm> norms;
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(ResMlp);

// The task: labels are the argmax of a fixed random two-layer network.
struct Task {
  torch::nn::Sequential teacher{torch::nn::Linear(kInputs, 64), torch::nn::Tanh(),
                                torch::nn::Linear(64, kClasses)};
  torch::Tensor eval_x, eval_y;
  Task() {
    torch::NoGradGuard no_grad;
    torch::manual_seed(1234);
    for (auto& p : teacher->parameters()) p.normal_(0, 0.3);
    eval_x = torch::randn({kEvalRows, kInputs});
    eval_y = label(eval_x);
  }
  torch::Tensor label(const torch::Tensor& x) {
    torch::NoGradGuard no_grad;
    return teacher->forward(x).argmax(1);
  }
  std::pair<torch::Tensor, torch::Tensor> batch(int rank, int64_t step, int rows) {
    torch::manual_seed(7919 * (step + 1) + rank);
    auto x = torch::randn({rows, kInputs});
    return {x, label(x)};
  }
};

// Runs `steps` steps of `mode` on this rank; prints (rank 0) "eval step=S
// loss=L" every `eval_every` steps when it is positive, then the result.
int rank_main(const Args& a) {
  torch::set_num_threads(1);
  init_process_group(InitOptions().backend(a.get("backend", "auto")));
  const std::string mode = a.get("mode", "ddp");
  const int rank = get_rank(), batch = a.num("batch", 32), steps = a.num("steps", 64);
  const int eval_every = a.num("eval-every", 0), fragments = mode == "streaming" ? a.num("fragments", 4) : 1;
  const double lr = std::stod(a.get("lr", "1e-3"));
  torch::manual_seed(0);
  ResMlp net(a.num("width", 1024), a.num("blocks", 12));
  Task task;
  auto loss_of = [](torch::Tensor logits, const torch::Tensor& y) { return torch::cross_entropy_loss(logits, y); };
  auto evaluate = [&] {
    torch::NoGradGuard no_grad;
    return loss_of(net->forward(task.eval_x), task.eval_y).item<double>();
  };
  std::unique_ptr<DistributedDataParallel<ResMlpImpl>> ddp;
  std::unique_ptr<torch::optim::AdamW> inner;
  std::unique_ptr<torch::optim::SGD> outer;
  std::unique_ptr<local_sgd::DiLoCo> diloco;
  if (mode == "ddp") {
    ddp = std::make_unique<DistributedDataParallel<ResMlpImpl>>(net.ptr());
    inner = std::make_unique<torch::optim::AdamW>(ddp->parameters(), torch::optim::AdamWOptions(lr));
  } else {
    inner = std::make_unique<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(lr));
    outer = std::make_unique<torch::optim::SGD>(
        net->parameters(), torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
    // Fragments: runs of consecutive parameters (the input layer with the
    // first blocks, the output with the last), each parameter in the
    // fragment its middle element falls in when the elements are cut in
    // `fragments` equal runs: as even in bytes as whole parameters allow.
    auto params = net->parameters();
    int64_t total = 0, before = 0;
    for (const auto& p : params) total += p.numel();
    std::vector<std::vector<torch::Tensor>> parts(fragments);
    for (const auto& p : params) {
      parts[(before + p.numel() / 2) * fragments / total].push_back(p);
      before += p.numel();
    }
    diloco = std::make_unique<local_sgd::DiLoCo>(
        parts, *inner, *outer,
        local_sgd::DiLoCoOptions().sync_every(a.num("sync-every", 32))
            .sync_delay(mode == "streaming" ? a.num("sync-delay", 4) : 0));
  }
  barrier();
  const auto t0 = Clock::now();
  double timed_from = 0;
  const int warmup = a.num("warmup", 0);
  for (int s = 0; s < steps; ++s) {
    if (s == warmup) barrier(), timed_from = std::chrono::duration<double>(Clock::now() - t0).count();
    auto [x, y] = task.batch(rank, s, batch);
    inner->zero_grad();
    loss_of(ddp ? ddp->forward(x) : net->forward(x), y).backward();
    if (diloco) diloco->step();
    else inner->step();
    if (rank == 0 && eval_every > 0 && (s + 1) % eval_every == 0)
      std::printf("eval step=%d loss=%.6f\n", s + 1, evaluate()), std::fflush(stdout);
  }
  const int64_t peak = diloco ? diloco->peak_sync_bytes() : 0;
  diloco.reset();  // waits for the averages still in flight
  barrier();
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count() - timed_from;
  int64_t numel = 0;
  for (const auto& p : net->parameters()) numel += p.numel();
  if (rank == 0)
    std::printf("result samples_per_s=%.3f seconds=%.3f peak_sync_bytes=%lld params=%lld\n",
                (steps - warmup) * 2.0 * batch / seconds, seconds, static_cast<long long>(peak),
                static_cast<long long>(numel));
  destroy_process_group();
  return 0;
}

// The "eval step=S loss=L" lines of a rank's output, by step.
std::map<int, double> curve(const std::string& out) {
  std::map<int, double> c;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    int step;
    double loss;
    if (std::sscanf(line.c_str(), "eval step=%d loss=%lf", &step, &loss) == 2) c[step] = loss;
  }
  return c;
}

const char* const kModes[] = {"ddp", "diloco", "streaming"};

void speed(const Args& a, Args rank_args) {
  const std::string rate = a.get("link-rate", "100mbit");
  const int h = a.num("sync-every", 32);
  ShapedLink link(rate);
  std::printf("\n1. speed: 2 ranks on 2 hosts joined by a %s link (tc tbf; no delay: this kernel has "
              "no netem)\n",
              rate.c_str());
  std::printf("%-10s %8s %10s %9s %12s %14s %9s\n", "run", "steps", "samples/s", "xDDP",
              "link_MB", "peak_sync_MB", "xDiLoCo");
  std::map<std::string, double> got, peak;
  for (const char* mode : kModes) {
    rank_args.flags["mode"] = mode;
    const bool is_ddp = std::string(mode) == "ddp";
    rank_args.flags["steps"] = std::to_string(is_ddp ? a.num("ddp-steps", 4) + 1 : 2 * h);
    rank_args.flags["warmup"] = is_ddp ? "1" : "0";
    const int64_t before = link.bytes();
    const auto out = run_ranks(2, "slow-links", rank_args, &link);
    got[mode] = field(out, "samples_per_s"), peak[mode] = field(out, "peak_sync_bytes");
    std::printf("%-10s %8s %10.2f %9.2f %12.1f %14.2f %9.3f\n", mode, rank_args.get("steps", "").c_str(),
                got[mode], got[mode] / got["ddp"], (link.bytes() - before) / 1e6, peak[mode] / 1e6,
                peak.count("diloco") && peak["diloco"] > 0 ? peak[mode] / peak["diloco"] : 0.0);
    std::fflush(stdout);
  }
}

void loss(const Args& a, Args rank_args) {
  const int h = a.num("sync-every", 32), steps = a.num("curve-steps", 512);
  const int rows = 2 * a.num("batch", 32);
  rank_args.flags["steps"] = std::to_string(steps);
  rank_args.flags["eval-every"] = std::to_string(h);
  std::printf("\n2. evaluation loss at equal samples (loopback; every %d steps = %d samples)\n", h, h * rows);
  std::map<std::string, std::map<int, double>> curves;
  for (const char* mode : kModes) {
    rank_args.flags["mode"] = mode;
    curves[mode] = curve(run_ranks(2, "slow-links", rank_args));
  }
  std::printf("%8s %10s %10s %10s %10s %12s %14s\n", "step", "samples", "ddp", "diloco",
              "streaming", "diloco/ddp", "streaming/dil");
  const std::string csv = a.get("csv", "");
  std::ofstream file;
  if (!csv.empty()) file.open(csv), file << "step,samples,ddp,diloco,streaming\n";
  for (const auto& [step, l] : curves["ddp"]) {
    const double d = curves["diloco"][step], s = curves["streaming"][step];
    std::printf("%8d %10d %10.4f %10.4f %10.4f %12.4f %14.4f\n", step, step * rows, l, d, s, d / l, s / d);
    if (file) file << step << ',' << step * rows << ',' << l << ',' << d << ',' << s << '\n';
  }
  if (!csv.empty()) std::printf("curves written to %s\n", csv.c_str());
  // One evaluation is noisy (DDP's moves by 10 % from one to the next):
  // the mean of the last 4 as well.
  std::map<std::string, double> tail;
  for (const char* mode : kModes) {
    const auto& c = curves[mode];
    int n = 0;
    for (auto it = c.rbegin(); it != c.rend() && n < 4; ++it, ++n) tail[mode] += it->second;
    tail[mode] /= std::max(n, 1);
  }
  std::printf("mean of the last 4 evaluations: ddp %.4f, diloco %.4f, streaming %.4f; diloco/ddp %.4f, "
              "streaming/diloco %.4f\n",
              tail["ddp"], tail["diloco"], tail["streaming"], tail["diloco"] / tail["ddp"],
              tail["streaming"] / tail["diloco"]);
}

}  // namespace slow_links

int slow_links_rank_main(const Args& a) { return slow_links::rank_main(a); }

int bench_slow_links(const Args& a) {
  Args rank_args;
  for (const char* k : {"width", "blocks", "batch", "sync-every", "fragments", "sync-delay", "lr", "backend"})
    if (a.flags.count(k)) rank_args.flags[k] = a.get(k, "");
  std::printf("slow-links: 2 ranks, residual MLP width %s x %s blocks, batch %s per rank, AdamW %s; "
              "DiLoCo H %s, outer SGD 0.7 Nesterov 0.9; Streaming: %s fragments, delay %s\n",
              a.get("width", "1024").c_str(), a.get("blocks", "12").c_str(), a.get("batch", "32").c_str(),
              a.get("lr", "1e-3").c_str(), a.get("sync-every", "32").c_str(),
              a.get("fragments", "4").c_str(), a.get("sync-delay", "4").c_str());
  const std::string parts = a.get("run", "speed,loss");
  if (parts.find("speed") != std::string::npos) slow_links::speed(a, rank_args);
  if (parts.find("loss") != std::string::npos) slow_links::loss(a, rank_args);
  return 0;
}

}  // namespace dtrain::bench
