// dtrain-bench: training benchmarks, always side by side with a baseline
// run in the same invocation, several interleaved runs, medians reported.
//
//   dtrain-bench ddp      [--world 2] [--steps 30] [--batch 64] [--runs 3] [--baseline PATH]
//       MNIST convnet DDP throughput vs PyTorch's Python DDP (PATH defaults to
//       ../shared/baselines/py_ddp_train.py), and 2-rank scaling vs one process.
//   dtrain-bench overlap  [--steps 10] [--batch 32] [--runs 3] [--layers 8] [--width 1024]
//       Deep MLP step time: compute alone, compute then communication, and DDP
//       (overlapped); prints the share of communication hidden behind backward.
//
// Ranks are child processes of this binary (`dtrain-bench rank ...`) that
// rendezvous over env:// on 127.0.0.1, one intra-op thread each.

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/dtrain.h"
#include "models.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::map<std::string, std::string> flags;
  std::string get(const std::string& k, const std::string& d) const {
    auto it = flags.find(k);
    return it == flags.end() ? d : it->second;
  }
  int num(const std::string& k, int d) const { return std::stoi(get(k, std::to_string(d))); }
};

Args parse(int argc, char** argv, int first) {
  Args a;
  for (int i = first; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k.rfind("--", 0) != 0) throw std::invalid_argument("unexpected argument " + k);
    a.flags[k.substr(2)] = argv[i + 1];
  }
  return a;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::string self_path() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw std::runtime_error("cannot find /proc/self/exe");
  buf[n] = 0;
  return buf;
}

// Runs a command and returns what it printed.
std::string capture(const std::string& cmd) {
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) throw std::runtime_error("cannot run: " + cmd);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), f)) out.append(buf, n);
  int rc = pclose(f);
  if (rc != 0) throw std::runtime_error("command failed (" + std::to_string(rc) + "): " + cmd + "\n" + out);
  return out;
}

double field(const std::string& text, const std::string& name) {
  std::smatch m;
  if (!std::regex_search(text, m, std::regex(name + "=([0-9.eE+-]+)")))
    throw std::runtime_error("no " + name + "= in output:\n" + text);
  return std::stod(m[1]);
}

// Starts `world` ranks of this binary; returns rank 0's output.
std::string run_ranks(int world, const std::string& mode, const Args& a) {
  static int port = 29810;
  port = port >= 29890 ? 29810 : port + 1;
  std::ostringstream cmd;
  const std::string exe = self_path();
  std::string rest = " rank " + mode;
  for (const auto& [k, v] : a.flags) rest += " --" + k + " " + v;
  for (int r = world - 1; r >= 0; --r) {
    cmd << "RANK=" << r << " WORLD_SIZE=" << world << " MASTER_ADDR=127.0.0.1 MASTER_PORT=" << port
        << " OMP_NUM_THREADS=1 " << exe << rest << (r > 0 ? " >/dev/null & " : "; wait");
  }
  return capture("sh -c '" + cmd.str() + "'");
}

// ---- inside a rank ---------------------------------------------------------

template <typename Step>
double time_steps(int steps, Step&& step) {
  for (int i = 0; i < 5; ++i) step();  // warm-up (and DDP's bucket rebuild)
  dtrain::barrier();
  auto t0 = Clock::now();
  for (int i = 0; i < steps; ++i) step();
  dtrain::barrier();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int rank_main(const std::string& mode, const Args& a) {
  torch::set_num_threads(1);
  dtrain::init_process_group();
  const int rank = dtrain::get_rank(), world = dtrain::get_world_size();
  const int steps = a.num("steps", 30), batch = a.num("batch", 64);
  torch::manual_seed(0);
  double seconds = 0, hidden = 0;
  if (mode == "ddp" || mode == "local" || mode == "ddp-nocomm") {
    auto net = dtrain::bench::MnistNet();
    auto x = torch::randn({batch, 1, 28, 28});
    auto y = torch::randint(0, 10, {batch});
    if (mode != "local") {
      dtrain::DistributedDataParallel ddp(net);
      if (mode == "ddp-nocomm") ddp.register_comm_hook([](dtrain::ProcessGroup&, dtrain::GradBucket&) {});
      torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
      seconds = time_steps(steps, [&] {
        opt.zero_grad();
        torch::nll_loss(ddp.forward(x), y).backward();
        opt.step();
      });
    } else {
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
      seconds = time_steps(steps, [&] {
        opt.zero_grad();
        torch::nll_loss(net->forward(x), y).backward();
        opt.step();
      });
    }
  } else {
    auto net = dtrain::bench::DeepMlp(a.num("layers", 8), a.num("width", 1024));
    auto x = torch::randn({batch, a.num("width", 1024)});
    auto target = torch::randn({batch, a.num("width", 1024)});
    dtrain::DistributedDataParallel ddp(
        net, dtrain::DDPOptions().bucket_cap_mb(std::stod(a.get("bucket_cap_mb", "25"))));
    torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.001));
    std::vector<double> fractions;
    seconds = time_steps(steps, [&] {
      opt.zero_grad();
      if (mode == "overlap-ddp") {
        torch::mse_loss(ddp.forward(x), target).backward();
        fractions.push_back(ddp.stats().hidden_fraction);
      } else {
        {
          auto guard = ddp.no_sync();
          torch::mse_loss(ddp.forward(x), target).backward();
        }
        if (mode == "overlap-sequential") {
          // The same bytes, all-reduced after backward instead of during it.
          std::vector<torch::Tensor> grads;
          for (auto& p : ddp.parameters()) grads.push_back(p.grad().view({-1}));
          auto flat = torch::cat(grads);
          dtrain::all_reduce(flat, dtrain::AllReduceOptions().op(dtrain::ReduceOp::AVG));
        }
      }
      opt.step();
    });
    hidden = median(fractions);
  }
  if (rank == 0) {
    std::printf("result step_ms=%.3f samples_per_s=%.1f hidden_stat=%.3f\n", seconds / steps * 1e3,
                steps * batch * world / seconds, hidden);
  }
  dtrain::destroy_process_group();
  return 0;
}

// ---- the benchmarks ----------------------------------------------------------

int bench_ddp(const Args& a) {
  const int world = a.num("world", 2), runs = a.num("runs", 3);
  const int steps = a.num("steps", 30), batch = a.num("batch", 64);
  const std::string baseline = a.get("baseline", "../shared/baselines/py_ddp_train.py");
  Args rank_args;
  rank_args.flags = {{"steps", std::to_string(steps)}, {"batch", std::to_string(batch)}};
  std::vector<double> py, ours, single, ratio, scaling;
  std::printf("%-4s %14s %14s %14s %10s %10s\n", "run", "pytorch_ddp/s", "dtrain_ddp/s",
              "dtrain_1proc/s", "ratio", "scaling");
  for (int r = 0; r < runs; ++r) {
    const double p = field(capture("/usr/bin/python3 " + baseline + " " + std::to_string(world) +
                                   " " + std::to_string(steps) + " " + std::to_string(batch) +
                                   " 2>/dev/null"),
                           "samples_per_s");
    const double d = field(run_ranks(world, "ddp", rank_args), "samples_per_s");
    const double s = field(run_ranks(1, "local", rank_args), "samples_per_s");
    py.push_back(p), ours.push_back(d), single.push_back(s);
    ratio.push_back(d / p), scaling.push_back(d / (world * s));
    std::printf("%-4d %14.1f %14.1f %14.1f %10.3f %10.3f\n", r, p, d, s, d / p, d / (world * s));
    std::fflush(stdout);
  }
  std::printf("median: dtrain/pytorch DDP samples/s = %.3f, %d-rank scaling efficiency = %.3f "
              "(world %d, batch %d/rank, %d steps, 1 thread/rank)\n",
              median(ratio), world, median(scaling), world, batch, steps);
  return 0;
}

int bench_overlap(const Args& a) {
  const int runs = a.num("runs", 5);
  Args rank_args;
  rank_args.flags = {{"steps", a.get("steps", "10")}, {"batch", a.get("batch", "8")},
                     {"layers", a.get("layers", "8")}, {"width", a.get("width", "1024")},
                     {"bucket_cap_mb", a.get("bucket_cap_mb", "25")}};
  std::vector<double> compute, sequential, overlapped, stat;
  std::printf("%-4s %12s %14s %12s %12s\n", "run", "compute_ms", "sequential_ms", "ddp_ms",
              "hidden_stat");
  for (int r = 0; r < runs; ++r) {
    compute.push_back(field(run_ranks(2, "overlap-compute", rank_args), "step_ms"));
    sequential.push_back(field(run_ranks(2, "overlap-sequential", rank_args), "step_ms"));
    auto out = run_ranks(2, "overlap-ddp", rank_args);
    overlapped.push_back(field(out, "step_ms"));
    stat.push_back(field(out, "hidden_stat"));
    std::printf("%-4d %12.1f %14.1f %12.1f %12.3f\n", r, compute.back(), sequential.back(),
                overlapped.back(), stat.back());
    std::fflush(stdout);
  }
  // From the medians: the communication that sequential execution adds,
  // and how much of it DDP's overlap removes.
  const double c = median(compute), s = median(sequential), o = median(overlapped);
  const double hidden = s > c ? (s - o) / (s - c) : 0;
  std::printf("median step: compute %.1f ms, compute+communication %.1f ms, DDP %.1f ms -> %.0f%% "
              "of communication hidden (DDP's own stat: %.0f%%; 2 ranks, %s layers of %s, batch "
              "%s, bucket_cap_mb %s)\n",
              c, s, o, 100 * hidden, 100 * median(stat), rank_args.get("layers", "").c_str(),
              rank_args.get("width", "").c_str(), rank_args.get("batch", "").c_str(),
              rank_args.get("bucket_cap_mb", "").c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  try {
    if (cmd == "rank" && argc > 2) return rank_main(argv[2], parse(argc, argv, 3));
    if (cmd == "ddp") return bench_ddp(parse(argc, argv, 2));
    if (cmd == "overlap") return bench_overlap(parse(argc, argv, 2));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain-bench: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "usage: dtrain-bench ddp|overlap [--flag value ...] (see the source header)\n");
  return 2;
}
