// dtrain-bench collectives: an nccl-tests-style sweep of one collective, run
// inside every rank of a job, e.g.
//
//   dtrain-run --standalone --nproc-per-node 2 dtrain-bench collectives
//       [--backend auto|shm|tcp] [--op all_reduce|broadcast|reduce|all_gather|gather|
//        scatter|reduce_scatter|all_to_all|all_gather_into_tensor|reduce_scatter_tensor|
//        send_recv]
//       [--dtype float32|float64|float16|bfloat16|int32|int64|uint8|int8]
//       [--redop sum|avg|prod|min|max]
//       [--min-bytes 4] [--max-bytes 268435456] [--iters N]
//       [--baseline ../shared/baselines/py_allreduce.py] [--baseline-mpi tcp|shm|both]
//       [--mpi-program PATH] [--runs 3]
//
// One row per size (powers of two): size (bytes of the result buffer, as
// nccl-tests), count (its elements), dtype, op (the reduction, or "none"),
// time_us (slowest rank), algbw = size / time and busbw (GB/s, nccl-tests'
// definitions: all_reduce busbw = algbw * 2(n-1)/n; all_gather,
// reduce_scatter (and their _tensor forms), all_to_all, gather, scatter
// algbw * (n-1)/n; broadcast and
// reduce busbw = algbw; send_recv, each rank sending to the next around a
// ring and receiving from the previous, busbw = algbw) and #wrong, the elements that differ from the
// exact expected result after one checked call (summed over ranks).
//
// --baseline runs PyTorch's gloo all_reduce (py_allreduce.py) side by side,
// interleaved --runs times with dtrain on the same sizes, and prints the
// ratios and the goals, with single-thread memcpy bandwidth measured
// in the same run. --baseline-mpi does the same with OpenMPI's MPI_Allreduce
// (mpi-allreduce-baseline, built beside dtrain-bench where MPI is found;
// --mpi-program names another): over TCP on loopback (tcp), with mpirun's
// default shared memory (shm), or both. Its sizes are fixed (4 KiB to 64 MiB) and each is timed
// over as many iterations as the table's default gives it: --iters, which
// would make 64 MiB run that many times too, applies to the table only.

#include "collectives.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <chrono>
#include <cstring>

#include "dtrain/dtrain.h"

namespace dtrain::bench {
namespace {

using Clock = std::chrono::steady_clock;

at::ScalarType parse_dtype(const std::string& s) {
  static const std::map<std::string, at::ScalarType> names = {
      {"float32", at::kFloat}, {"float64", at::kDouble}, {"float16", at::kHalf},
      {"bfloat16", at::kBFloat16}, {"int32", at::kInt}, {"int64", at::kLong},
      {"uint8", at::kByte}, {"int8", at::kChar}};
  auto it = names.find(s);
  if (it == names.end()) throw std::invalid_argument("--dtype " + s + " is not one of float32, float64, float16, bfloat16, int32, int64, uint8, int8");
  return it->second;
}

ReduceOp parse_redop(const std::string& s) {
  static const std::map<std::string, ReduceOp> names = {{"sum", ReduceOp::SUM},
                                                        {"avg", ReduceOp::AVG},
                                                        {"prod", ReduceOp::PRODUCT},
                                                        {"min", ReduceOp::MIN},
                                                        {"max", ReduceOp::MAX}};
  auto it = names.find(s);
  if (it == names.end()) throw std::invalid_argument("--redop " + s + " is not one of sum, avg, prod, min, max");
  return it->second;
}

// Values 1..3: every reduction of up to 4 ranks is exact in every dtype.
at::Tensor fill(int64_t seed, int64_t count, at::ScalarType dtype) {
  return (at::fmod(at::arange(count, at::kDouble) + seed, 3) + 1).to(dtype);
}

at::Tensor reduced(int world, int64_t count, at::ScalarType dtype, ReduceOp op,
                   int64_t seed_step = 0, int64_t offset = 0) {
  auto acc = fill(offset, count, at::kDouble);
  for (int r = 1; r < world; ++r) {
    auto x = fill(r * seed_step + r + offset, count, at::kDouble);
    if (op == ReduceOp::PRODUCT) acc = acc * x;
    else if (op == ReduceOp::MIN) acc = at::minimum(acc, x);
    else if (op == ReduceOp::MAX) acc = at::maximum(acc, x);
    else acc = acc + x;
  }
  if (op != ReduceOp::AVG) return acc.to(dtype);
  return at::isFloatingType(dtype) ? acc.to(dtype).div(world) : acc.div(world, "trunc").to(dtype);
}

int64_t wrong(const at::Tensor& actual, const at::Tensor& expected) {
  return actual.ne(expected).sum().item<int64_t>();
}

// One collective on tensors prepared for one size: run() issues it, check()
// counts this rank's wrong elements after a run on fresh inputs.
struct Case {
  std::function<void()> reset;
  std::function<void()> run;
  std::function<int64_t()> check;
  double bus_factor;
};

Case make_case(const std::string& op, int64_t count, at::ScalarType dt, ReduceOp redop) {
  const int n = get_world_size(), me = get_rank();
  const int64_t per = count / n;  // per-rank part for the gather-like ops
  const double ring = double(n - 1) / n;
  auto g = default_group();
  Case c;
  if (op == "all_reduce" || op == "broadcast" || op == "reduce") {
    auto t = std::make_shared<at::Tensor>();
    c.reset = [=] { *t = fill(me, count, dt); };
    if (op == "all_reduce") {
      // As torch.distributed's all_reduce(t) without async_op, which the
      // baseline calls.
      c.run = [=] { all_reduce(*t, AllReduceOptions().op(redop).group(g)); };
      c.check = [=] { return wrong(*t, reduced(n, count, dt, redop)); };
      c.bus_factor = 2 * ring;
    } else if (op == "broadcast") {
      c.run = [=] { g->broadcast(*t, 0)->wait(); };
      c.check = [=] { return wrong(*t, fill(0, count, dt)); };
      c.bus_factor = 1;
    } else {
      c.run = [=] { g->reduce(*t, 0, redop)->wait(); };
      c.check = [=] {
        return wrong(*t, me == 0 ? reduced(n, count, dt, redop) : fill(me, count, dt));
      };
      c.bus_factor = 1;
    }
    return c;
  }
  if (op == "send_recv") {  // around a ring: to rank + 1, from rank - 1
    auto out = std::make_shared<at::Tensor>(), in = std::make_shared<at::Tensor>();
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    c.reset = [=] {
      *out = fill(me, count, dt);
      *in = at::zeros({count}, dt);
    };
    c.run = [=] {
      auto r = g->recv(*in, prev);
      g->send(*out, next)->wait();
      r->wait();
    };
    c.check = [=] { return wrong(*in, fill(prev, count, dt)); };
    c.bus_factor = 1;
    return c;
  }
  auto in = std::make_shared<std::vector<at::Tensor>>();
  auto out = std::make_shared<std::vector<at::Tensor>>();
  c.bus_factor = ring;
  if (op == "all_gather" || op == "gather") {
    const bool all = op == "all_gather";
    c.reset = [=] {
      *in = {fill(me, per, dt)};
      out->clear();
      if (all || me == 0)
        for (int j = 0; j < n; ++j) out->push_back(at::zeros({per}, dt));
    };
    c.run = [=] {
      (all ? g->all_gather(*out, (*in)[0]) : g->gather(*out, (*in)[0], 0))->wait();
    };
    c.check = [=] {
      int64_t bad = 0;
      for (int j = 0; j < static_cast<int>(out->size()); ++j) bad += wrong((*out)[j], fill(j, per, dt));
      return bad;
    };
  } else if (op == "scatter") {
    c.reset = [=] {
      in->clear();
      if (me == 0)
        for (int j = 0; j < n; ++j) in->push_back(fill(10 + j, per, dt));
      *out = {at::zeros({per}, dt)};
    };
    c.run = [=] { g->scatter((*out)[0], *in, 0)->wait(); };
    c.check = [=] { return wrong((*out)[0], fill(10 + me, per, dt)); };
  } else if (op == "reduce_scatter") {
    c.reset = [=] {
      auto full = fill(me, per * n, dt);
      auto chunks = full.chunk(n);
      *in = std::vector<at::Tensor>(chunks.begin(), chunks.end());
      *out = {at::zeros({per}, dt)};
    };
    c.run = [=] { g->reduce_scatter((*out)[0], *in, redop)->wait(); };
    c.check = [=] {
      return wrong((*out)[0], reduced(n, per * n, dt, redop).narrow(0, me * per, per));
    };
  } else if (op == "all_gather_into_tensor") {
    c.reset = [=] {
      *in = {fill(me, per, dt)};
      *out = {at::zeros({per * n}, dt)};
    };
    c.run = [=] { g->all_gather_into_tensor((*out)[0], (*in)[0])->wait(); };
    c.check = [=] {
      int64_t bad = 0;
      for (int j = 0; j < n; ++j) bad += wrong((*out)[0].narrow(0, j * per, per), fill(j, per, dt));
      return bad;
    };
  } else if (op == "reduce_scatter_tensor") {
    c.reset = [=] {
      *in = {fill(me, per * n, dt)};
      *out = {at::zeros({per}, dt)};
    };
    c.run = [=] { g->reduce_scatter_tensor((*out)[0], (*in)[0], redop)->wait(); };
    c.check = [=] {
      return wrong((*out)[0], reduced(n, per * n, dt, redop).narrow(0, me * per, per));
    };
  } else if (op == "all_to_all") {
    const int64_t each = per / n;
    c.reset = [=] {
      in->clear();
      out->clear();
      for (int j = 0; j < n; ++j) {
        in->push_back(fill(me * n + j, each, dt));
        out->push_back(at::zeros({each}, dt));
      }
    };
    c.run = [=] { g->all_to_all(*out, *in)->wait(); };
    c.check = [=] {
      int64_t bad = 0;
      for (int j = 0; j < n; ++j) bad += wrong((*out)[j], fill(j * n + me, each, dt));
      return bad;
    };
  } else {
    throw std::invalid_argument("--op " + op + " is not one of all_reduce, broadcast, reduce, all_gather, gather, scatter, reduce_scatter, all_to_all, all_gather_into_tensor, reduce_scatter_tensor, send_recv");
  }
  return c;
}

struct Row {
  double time_us, algbw, busbw;
  int64_t wrong;
};

// Times one size on every rank; the slowest rank's time counts.
Row measure(const std::string& op, int64_t bytes, at::ScalarType dt, ReduceOp redop, int iters) {
  const int64_t count = bytes / static_cast<int64_t>(c10::elementSize(dt));
  Case c = make_case(op, count, dt, redop);
  c.reset();
  c.run();
  auto bad = at::tensor({c.check()}, at::kLong);
  all_reduce(bad);
  // 1 GiB moved per size, within 5 and 20,000 iterations: a small size is
  // timed over tens of milliseconds, so one stall of the machine (another
  // process ending) does not make its average.
  if (iters <= 0) iters = static_cast<int>(std::clamp<int64_t>((1LL << 30) / bytes, 5, 20000));
  for (int i = 0; i < 2; ++i) c.run();
  barrier();
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) c.run();
  auto seconds = at::tensor({std::chrono::duration<double>(Clock::now() - t0).count() / iters},
                            at::kDouble);
  all_reduce(seconds, AllReduceOptions().op(ReduceOp::MAX));
  const double s = seconds.item<double>();
  const double algbw = bytes / s / 1e9;
  return {s * 1e6, algbw, algbw * c.bus_factor, bad.item<int64_t>()};
}

// Single-thread memcpy bandwidth (GB/s, bytes copied per second) on rank 0,
// while the others wait.
double memcpy_gbps(size_t bytes) {
  double best = 0;
  if (get_rank() == 0) {
    std::vector<char> a(bytes, 1), b(bytes, 2);
    for (int run = 0; run < 5; ++run) {
      const auto t0 = Clock::now();
      for (int i = 0; i < 10; ++i) std::memcpy(i % 2 ? a.data() : b.data(), i % 2 ? b.data() : a.data(), bytes);
      best = std::max(best, 10.0 * bytes / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9);
    }
  }
  barrier();
  return best;
}

struct Baseline {
  std::string name;     // "gloo", "OpenMPI tcp", "OpenMPI shm"
  // Prints "bytes= time_us= busbw_GBps=" lines. Made on rank 0 when first
  // run: finding the Python interpreter starts one (a fork of this rank),
  // which must not happen on the ranks before they are measured (it left
  // auto's small all_reduces 2-7x slower for the rest of the run).
  std::function<std::string()> make_command;
  std::string command;
  std::map<int64_t, std::vector<double>> us, busbw;  // by size, one per run
};

// Runs a baseline on rank 0 (the others wait) and keeps its figures.
void run_baseline(Baseline& b) {
  if (get_rank() == 0) {
    if (b.command.empty()) b.command = b.make_command();
    const auto out = capture(b.command + " 2>&1");
    std::regex line("bytes=\\s*([0-9]+)\\s+time_us=\\s*([0-9.]+)\\s+busbw_GBps=\\s*([0-9.]+)");
    bool any = false;
    for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it) {
      b.us[std::stoll((*it)[1])].push_back(std::stod((*it)[2]));
      b.busbw[std::stoll((*it)[1])].push_back(std::stod((*it)[3]));
      any = true;
    }
    if (!any) throw std::runtime_error("no results from " + b.command + ":\n" + out);
  }
  barrier();
}

// OpenMPI's MPI_Allreduce (bench/baselines/mpi_allreduce.cpp, built beside
// this program as mpi-allreduce-baseline) over TCP only (the ob1 PML with the
// tcp and self BTLs, on loopback) or as mpirun picks by default on one host
// (shared memory: vader). Started by rank 0 with the job's variables removed.
std::string mpi_command(const Args& a, const std::string& transport, int world) {
  auto program = a.get("mpi-program", "");
  if (program.empty()) program = self_path().substr(0, self_path().rfind('/')) + "/mpi-allreduce-baseline";
  if (transport != "tcp" && transport != "shm")
    throw std::invalid_argument("--baseline-mpi " + transport + " is not one of tcp, shm");
  return "env -u RANK -u LOCAL_RANK -u WORLD_SIZE -u LOCAL_WORLD_SIZE -u GROUP_RANK "
         "-u MASTER_ADDR -u MASTER_PORT mpirun --allow-run-as-root --oversubscribe -np " +
         std::to_string(world) +
         (transport == "tcp" ? " --mca btl tcp,self --mca pml ob1 --mca btl_tcp_if_include lo" : "") +
         " " + program;
}

// Interleaved runs of dtrain and each baseline on the same sizes; medians.
void compare_with_baselines(const Args& a, at::ScalarType dt, ReduceOp redop) {
  const int runs = a.num("runs", 3), world = get_world_size(), me = get_rank();
  std::vector<Baseline> bases;
  if (!a.get("baseline", "").empty())
    bases.push_back({"gloo", [&] { return python_of(a) + " " + a.get("baseline", "") + " " +
                                          std::to_string(world); }, "", {}, {}});
  for (const std::string& t : {std::string("tcp"), std::string("shm")})
    if (a.get("baseline-mpi", "") == t || a.get("baseline-mpi", "") == "both")
      bases.push_back({"OpenMPI " + t, [&a, t, world] { return mpi_command(a, t, world); }, "", {}, {}});
  const std::vector<int64_t> sizes = {4096, 65536, 1 << 20, 4 << 20, 16 << 20, 64 << 20};
  std::map<int64_t, std::vector<double>> ours_bw, ours_us;
  std::vector<double> memcpy_runs, memcpy_big_runs;
  for (int run = 0; run < runs; ++run) {
    for (auto bytes : sizes) {
      const Row row = measure("all_reduce", bytes, dt, redop, 0);
      ours_us[bytes].push_back(row.time_us);
      ours_bw[bytes].push_back(row.busbw);
    }
    if (me == 0)
      std::printf("run %d of %d: dtrain %.1f us at 4 KiB, %.1f us at 16 MiB\n", run + 1, runs,
                  ours_us[4096].back(), ours_us[16 << 20].back());
    memcpy_runs.push_back(memcpy_gbps(16 << 20));
    memcpy_big_runs.push_back(memcpy_gbps(256 << 20));
    for (auto& b : bases) run_baseline(b);
  }
  if (me != 0) return;
  const std::string backend = default_group()->backend_name();
  std::printf("\n# all_reduce float32, %d ranks: dtrain (%s) beside", world, backend.c_str());
  for (const auto& b : bases) std::printf(" %s (%s)", b.name.c_str(), b.command.c_str());
  std::printf("; medians of %d interleaved runs; ratios are dtrain's speed over the baseline's "
              "(time_base / time_dtrain: above 1, dtrain is faster)\n", runs);
  std::printf("%10s %11s %10s", "size", "dtrain_us", "dtrain_bw");
  for (const auto& b : bases) {
    const auto n = b.name.substr(b.name.rfind(' ') + 1);
    std::printf(" %9s %9s %7s", (n + "_us").c_str(), (n + "_bw").c_str(), ("x" + n).c_str());
  }
  std::printf("\n");
  // Ratio per run (same run: the machine's state is shared), then the median.
  auto ratio = [&](const Baseline& b, int64_t bytes) {
    std::vector<double> r;
    const auto& theirs = b.us.at(bytes);
    for (size_t i = 0; i < std::min(theirs.size(), ours_us[bytes].size()); ++i)
      r.push_back(theirs[i] / ours_us[bytes][i]);
    return median(r);
  };
  for (auto bytes : sizes) {
    std::printf("%10lld %11.1f %10.3f", static_cast<long long>(bytes), median(ours_us[bytes]),
                median(ours_bw[bytes]));
    for (const auto& b : bases) {
      if (!b.us.count(bytes)) {
        std::printf(" %9s %9s %7s", "-", "-", "-");
        continue;
      }
      std::printf(" %9.1f %9.3f %7.2f", median(b.us.at(bytes)), median(b.busbw.at(bytes)),
                  ratio(b, bytes));
    }
    std::printf("\n");
  }
  const double mc = median(memcpy_runs), big_mc = median(memcpy_big_runs);
  const int64_t big = 16 << 20, small = 4096;
  std::printf("single-thread memcpy of 16 MiB: %.2f GB/s; of 256 MiB (beyond the caches): %.2f "
              "GB/s (same run, bytes copied per second)\n", mc, big_mc);
  // The goals (issue 56, the data plane's): dtrain's tcp against OpenMPI
  // over TCP, auto/shm against OpenMPI's shared memory, both at 1.0x in 4
  // KiB latency and 16 MiB bandwidth; against gloo, tcp 1.6x at 16 MiB and
  // shared memory 1/200 of its 4 KiB latency.
  const bool network = backend == "tcp";
  for (const auto& b : bases) {
    if (!b.us.count(big) || !b.us.count(small)) continue;
    const bool gloo = b.name == "gloo";
    if (!gloo && (b.name == "OpenMPI tcp") != network) {
      std::printf("%s: for reference (the goals compare %s with OpenMPI %s)\n", b.name.c_str(),
                  backend.c_str(), network ? "tcp" : "shm");
      continue;
    }
    const double bw_goal = gloo ? (network ? 1.6 : 4) : 1, lat_goal = gloo ? (network ? 1 : 200) : 1;
    std::printf("goal all_reduce at 16 MiB >= %.1fx %s: %.2fx -> %s\n", bw_goal, b.name.c_str(),
                ratio(b, big), ratio(b, big) >= bw_goal ? "met" : "NOT met");
    std::printf("goal 4 KiB all_reduce %.0fx as fast as %s: %.2fx -> %s\n", lat_goal,
                b.name.c_str(), ratio(b, small), ratio(b, small) >= lat_goal ? "met" : "NOT met");
  }
  if (!network) {
    const double bw = median(ours_bw[big]);
    std::printf("goal all_reduce busbw at 16 MiB >= 50%% of memcpy: %.0f%% of the 16 MiB memcpy "
                "(cache-hot) -> %s; %.0f%% of the 256 MiB memcpy (memory) -> %s\n",
                100 * bw / mc, bw >= 0.5 * mc ? "met" : "NOT met", 100 * bw / big_mc,
                bw >= 0.5 * big_mc ? "met" : "NOT met");
  }
}

}  // namespace

int bench_collectives(const Args& a) {
  torch::set_num_threads(1);
  const std::string op = a.get("op", "all_reduce");
  const auto dt = parse_dtype(a.get("dtype", "float32"));
  const auto redop = parse_redop(a.get("redop", "sum"));
  const bool reduces = op == "all_reduce" || op == "reduce" || op == "reduce_scatter" ||
                       op == "reduce_scatter_tensor";
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dt));
  const int64_t min_bytes = std::max<int64_t>(elem, std::stoll(a.get("min-bytes", "4")));
  const int64_t max_bytes = std::stoll(a.get("max-bytes", "268435456"));
  const bool baselines = !a.get("baseline", "").empty() || !a.get("baseline-mpi", "").empty();
  if (baselines && (op != "all_reduce" || dt != at::kFloat))
    throw std::invalid_argument("--baseline and --baseline-mpi compare all_reduce on float32 "
                                "(what py_allreduce.py and mpi_allreduce.cpp measure)");
  init_process_group(InitOptions().backend(a.get("backend", "auto")));
  const int n = get_world_size();
  // Ops that split the buffer among ranks need at least one element each.
  const int64_t split = op == "all_to_all" ? int64_t(n) * n
                        : (op == "all_reduce" || op == "broadcast" || op == "reduce") ? 1 : n;
  if (get_rank() == 0) {
    std::printf("%s\n", build_line().c_str());
    std::printf("# dtrain-bench collectives: %s on backend %s, %d ranks, %s\n", op.c_str(),
                default_group()->backend_name().c_str(), n, a.get("dtype", "float32").c_str());
    std::printf("%12s %12s %9s %6s %12s %9s %9s %7s\n", "size", "count", "dtype", "op",
                "time_us", "algbw", "busbw", "#wrong");
  }
  int64_t total_wrong = 0;
  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    if (bytes / elem < split) continue;
    const int64_t usable = bytes / (elem * split) * split * elem;
    const Row row = measure(op, usable, dt, redop, a.num("iters", 0));
    total_wrong += row.wrong;
    if (get_rank() == 0) {
      std::printf("%12lld %12lld %9s %6s %12.2f %9.3f %9.3f %7lld\n",
                  static_cast<long long>(usable), static_cast<long long>(usable / elem),
                  a.get("dtype", "float32").c_str(), reduces ? a.get("redop", "sum").c_str() : "none",
                  row.time_us, row.algbw, row.busbw, static_cast<long long>(row.wrong));
      std::fflush(stdout);
    }
  }
  if (baselines) compare_with_baselines(a, dt, redop);
  destroy_process_group();
  return total_wrong == 0 ? 0 : 3;
}

}  // namespace dtrain::bench
