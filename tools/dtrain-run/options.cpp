#include "options.h"

#include <CLI/CLI.hpp>
#include <dirent.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <random>
#include <sstream>
#include <thread>

namespace dtrain::run {
namespace {

[[noreturn]] void bad(const CLI::App& app, const std::string& message) {
  throw UsageError(2, "dtrain-run: " + message + "\n\n" + app.help());
}

int gpu_count() {
  int n = 0;
  if (DIR* d = opendir("/proc/driver/nvidia/gpus")) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') ++n;
    closedir(d);
  }
  return n;
}

int to_int(const CLI::App& app, const std::string& flag, const std::string& text, int lo, int hi) {
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < lo || v > hi)
    bad(app, flag + " " + text + ": expected a whole number in " + std::to_string(lo) + ".." +
                 std::to_string(hi));
  return static_cast<int>(v);
}

std::map<int, Std> parse_std(const CLI::App& app, const std::string& flag, const std::string& text) {
  std::map<int, Std> out;
  if (text.find(':') == std::string::npos) {
    out[-1] = static_cast<Std>(to_int(app, flag, text, 0, 3));
    return out;
  }
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    auto colon = item.find(':');
    if (colon == std::string::npos) bad(app, flag + " " + text + ": expected N or LOCAL_RANK:N,...");
    out[to_int(app, flag, item.substr(0, colon), 0, 1 << 20)] =
        static_cast<Std>(to_int(app, flag, item.substr(colon + 1), 0, 3));
  }
  return out;
}

std::chrono::milliseconds seconds_value(const CLI::App& app, const std::string& what,
                                        const std::string& text) {
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || v < 0) bad(app, what + "=" + text + ": expected seconds >= 0");
  return std::chrono::milliseconds(static_cast<long long>(v * 1000));
}

}  // namespace

Std Options::redirect_of(int lr) const {
  auto it = redirects.find(lr);
  if (it == redirects.end()) it = redirects.find(-1);
  return it == redirects.end() ? Std::None : it->second;
}

Std Options::tee_of(int lr) const {
  auto it = tee.find(lr);
  if (it == tee.end()) it = tee.find(-1);
  return it == tee.end() ? Std::None : it->second;
}

bool Options::shown(int lr) const {
  if (local_ranks_filter.empty()) return true;
  for (int r : local_ranks_filter)
    if (r == lr) return true;
  return false;
}

namespace {

// Flags as typed, before they are checked and turned into Options.
struct Typed {
  std::string nproc = "1", nnodes = "1", rdzv_conf, redirects = "0", tee = "0", filter;
  double monitor = 0.1;
  bool no_python = false, module_flag = false;
};

void declare_options(CLI::App& app, Options& o, Typed& t) {
  app.get_formatter()->column_width(34);
  auto opt = [&](const std::string& names, auto& target, const std::string& help,
                 const std::string& pet) {
    return app.add_option(names, target, help)->envname("PET_" + pet)->capture_default_str();
  };
  opt("--nproc-per-node,--nproc_per_node", t.nproc,
      "Workers per node: a number, auto (GPUs if any, else CPUs), cpu or gpu", "NPROC_PER_NODE");
  opt("--nnodes", t.nnodes, "Number of nodes, or MIN:MAX for elastic jobs", "NNODES");
  opt("--node-rank,--node_rank", o.node_rank, "Rank of this node (static rendezvous)", "NODE_RANK");
  opt("--master-addr,--master_addr", o.master_addr,
      "Address of node 0, which hosts the rendezvous store (static)", "MASTER_ADDR");
  opt("--master-port,--master_port", o.master_port, "Port of node 0's rendezvous store (static)",
      "MASTER_PORT");
  app.add_flag("--standalone", o.standalone,
               "Single node: local rendezvous on a free port, no other flags needed")
      ->envname("PET_STANDALONE");
  opt("--rdzv-backend,--rdzv_backend", o.rdzv_backend, "static or c10d (dynamic, elastic)",
      "RDZV_BACKEND");
  opt("--rdzv-endpoint,--rdzv_endpoint", o.rdzv_endpoint,
      "host[:port] of the c10d rendezvous store (the node owning host hosts it; port 29400)",
      "RDZV_ENDPOINT");
  opt("--rdzv-id,--rdzv_id", o.rdzv_id, "Job id shared by all nodes of one job", "RDZV_ID");
  opt("--rdzv-conf,--rdzv_conf", t.rdzv_conf,
      "k=v,... : join_timeout, last_call_timeout, close_timeout, keep_alive_interval, "
      "keep_alive_max_attempt (seconds / count)",
      "RDZV_CONF");
  opt("--max-restarts,--max_restarts", o.max_restarts,
      "Restarts of the whole job after a worker fails", "MAX_RESTARTS");
  opt("--monitor-interval,--monitor_interval", t.monitor, "Seconds between worker checks",
      "MONITOR_INTERVAL");
  opt("--role", o.role, "Role name of the workers (ROLE_NAME)", "ROLE");
  opt("--log-dir,--log_dir", o.log_dir, "Directory for per-rank log files", "LOG_DIR");
  opt("--redirects,-r", t.redirects,
      "Send stdout (1), stderr (2) or both (3) to files in --log-dir; N or LOCAL_RANK:N,...",
      "REDIRECTS");
  opt("--tee,-t", t.tee, "Like --redirects but also to the console", "TEE");
  opt("--local-ranks-filter,--local_ranks_filter", t.filter,
      "Comma-separated local ranks whose output is shown on the console", "LOCAL_RANKS_FILTER");
  opt("--local-addr,--local_addr", o.local_addr,
      "This node's address as other nodes reach it (default: the route to the store)",
      "LOCAL_ADDR");
  app.add_flag("--keep-stdin,--keep_stdin", o.keep_stdin,
               "Workers read dtrain-run's standard input (default: /dev/null; a worker reading "
               "a terminal would be stopped by SIGTTIN)");
  // (No PET_ alias: the replicas' launchers inherit the environment.)
  app.add_option("--replicas", o.replicas,
                 "Fault tolerance on one node: run this many replica groups of --nproc-per-node workers, each "
                 "with a rendezvous and --max-restarts of its own (a failure restarts only its replica's "
                 "workers), and a lighthouse unless DTRAIN_FT_LIGHTHOUSE names one (docs/fault-tolerance.md)");
  app.add_flag("--no-python,--no_python", t.no_python,
               "Accepted for torchrun compatibility (dtrain-run always runs PROGRAM directly)");
  app.add_flag("-m,--module", t.module_flag, "Not supported (no Python); rejected");
  app.add_option("program", o.program, "The program to run, followed by its arguments")->required();
}

// Splits argv by hand: launcher flags (and their values) come first, then
// PROGRAM and everything after it, untouched — even what looks like a flag.
// Parses the launcher's part; PROGRAM's arguments go to o.args.
void parse_command_line(CLI::App& app, int argc, char** argv, Options& o) {
  std::vector<std::string> launcher_args;
  int program_at = argc;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") {
      program_at = i + 1;
      break;
    }
    if (a.size() < 2 || a[0] != '-') {
      program_at = i;
      break;
    }
    launcher_args.push_back(a);
    if (a.find('=') != std::string::npos) continue;
    const CLI::Option* known = app.get_option_no_throw(a);
    if (!known) continue;  // CLI11 reports it below, with usage
    if (known->get_items_expected_min() > 0 && i + 1 < argc) launcher_args.push_back(argv[++i]);
  }
  o.launcher_args = launcher_args;
  if (program_at < argc) launcher_args.push_back(argv[program_at]);
  std::vector<std::string> reversed(launcher_args.rbegin(), launcher_args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    throw UsageError(0, app.help());
  } catch (const CLI::ParseError& e) {
    bad(app, e.what());
  }
  for (int i = program_at + 1; i < argc; ++i) o.args.push_back(argv[i]);
}

// Workers per node, nodes, and the plain numeric flags.
void check_sizes(const CLI::App& app, const Typed& t, Options& o) {
  if (t.module_flag) bad(app, "-m/--module runs Python modules; dtrain-run runs programs directly");
  o.monitor_interval = std::chrono::milliseconds(static_cast<long long>(t.monitor * 1000));
  if (t.monitor <= 0) bad(app, "--monitor-interval must be positive");
  if (t.nproc == "auto") {
    o.nproc_per_node = gpu_count() > 0 ? gpu_count() : static_cast<int>(std::thread::hardware_concurrency());
  } else if (t.nproc == "cpu") {
    o.nproc_per_node = static_cast<int>(std::thread::hardware_concurrency());
  } else if (t.nproc == "gpu") {
    o.nproc_per_node = gpu_count();
    if (o.nproc_per_node == 0) bad(app, "--nproc-per-node gpu: this machine has no NVIDIA GPU");
  } else {
    o.nproc_per_node = to_int(app, "--nproc-per-node", t.nproc, 1, 4096);
  }
  auto colon = t.nnodes.find(':');
  if (colon == std::string::npos) {
    o.min_nodes = o.max_nodes = to_int(app, "--nnodes", t.nnodes, 1, 1 << 20);
  } else {
    o.min_nodes = to_int(app, "--nnodes", t.nnodes.substr(0, colon), 1, 1 << 20);
    o.max_nodes = to_int(app, "--nnodes", t.nnodes.substr(colon + 1), 1, 1 << 20);
    if (o.min_nodes > o.max_nodes)
      bad(app, "--nnodes " + t.nnodes + ": MIN must not exceed MAX");
  }
  if (o.master_port < 1 || o.master_port > 65535)
    bad(app, "--master-port " + std::to_string(o.master_port) + ": expected 1..65535");
  if (o.max_restarts < 0) bad(app, "--max-restarts must be >= 0");
  if (o.rdzv_backend != "static" && o.rdzv_backend != "c10d")
    bad(app, "--rdzv-backend " + o.rdzv_backend + ": expected static or c10d");
}

void apply_rdzv_conf(const CLI::App& app, const std::string& rdzv_conf, Options& o) {
  std::stringstream conf(rdzv_conf);
  std::string item;
  while (std::getline(conf, item, ',')) {
    if (item.empty()) continue;
    auto eq = item.find('=');
    if (eq == std::string::npos) bad(app, "--rdzv-conf " + item + ": expected key=value");
    auto key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "join_timeout" || key == "timeout") o.join_timeout = seconds_value(app, key, value);
    else if (key == "last_call_timeout") o.last_call_timeout = seconds_value(app, key, value);
    else if (key == "close_timeout") o.close_timeout = seconds_value(app, key, value);
    else if (key == "keep_alive_interval") o.keep_alive_interval = seconds_value(app, key, value);
    else if (key == "keep_alive_max_attempt")
      o.keep_alive_max_attempt = to_int(app, "keep_alive_max_attempt", value, 1, 1000);
    else
      bad(app, "--rdzv-conf: unknown key '" + key +
                   "' (known: join_timeout, last_call_timeout, close_timeout, "
                   "keep_alive_interval, keep_alive_max_attempt)");
  }
}

// --standalone, and what static or c10d rendezvous needs.
void check_rendezvous(const CLI::App& app, const std::string& nnodes, Options& o) {
  if (o.standalone) {
    if (o.max_nodes != 1) bad(app, "--standalone runs on one node; drop --nnodes " + nnodes);
    o.rdzv_backend = "c10d";
    o.rdzv_endpoint = "127.0.0.1:0";
    std::random_device rd;
    std::ostringstream id;
    id << std::hex << rd() << rd();
    o.rdzv_id = id.str();
  }
  if (o.rdzv_backend == "static") {
    if (o.min_nodes != o.max_nodes)
      bad(app, "--nnodes " + nnodes + ": MIN:MAX needs --rdzv-backend c10d");
    if (o.node_rank < 0 || o.node_rank >= o.max_nodes)
      bad(app, "--node-rank " + std::to_string(o.node_rank) + " is out of range for --nnodes " +
                   nnodes + " (expected 0.." + std::to_string(o.max_nodes - 1) + ")");
    return;
  }
  if (o.rdzv_endpoint.empty()) bad(app, "--rdzv-backend c10d needs --rdzv-endpoint host[:port]");
  auto c = o.rdzv_endpoint.rfind(':');
  if (c != std::string::npos && o.rdzv_endpoint.find(']') == std::string::npos &&
      o.rdzv_endpoint.find(':') == c) {
    o.rdzv_host = o.rdzv_endpoint.substr(0, c);
    o.rdzv_port = to_int(app, "--rdzv-endpoint port", o.rdzv_endpoint.substr(c + 1), 0, 65535);
  } else {
    o.rdzv_host = o.rdzv_endpoint;
  }
}

// --replicas: one node, each replica its own rendezvous there.
void check_replicas(const CLI::App& app, Options& o) {
  if (o.replicas == 0) return;
  if (o.replicas < 0 || o.replicas > 1024)
    bad(app, "--replicas " + std::to_string(o.replicas) + ": expected 1..1024");
  if (o.max_nodes != 1)
    bad(app, "--replicas runs every replica group on this node; drop --nnodes (on several hosts, run one "
             "dtrain-run per replica with DTRAIN_FT_REPLICA_ID and DTRAIN_FT_LIGHTHOUSE set)");
  if (o.rdzv_backend != "static" || !o.rdzv_endpoint.empty())
    bad(app, "--replicas gives each replica a rendezvous of its own on this node; drop --rdzv-backend and "
             "--rdzv-endpoint");
}

// --redirects, --tee, --local-ranks-filter and the --log-dir they need.
void check_output(const CLI::App& app, const Typed& t, Options& o) {
  o.redirects = parse_std(app, "--redirects", t.redirects);
  o.tee = parse_std(app, "--tee", t.tee);
  std::stringstream fs(t.filter);
  std::string item;
  while (std::getline(fs, item, ','))
    if (!item.empty()) o.local_ranks_filter.push_back(to_int(app, "--local-ranks-filter", item, 0, 1 << 20));
  bool any_file = false;
  for (int lr = 0; lr < o.nproc_per_node; ++lr)
    any_file = any_file || o.redirect_of(lr) != Std::None || o.tee_of(lr) != Std::None;
  if (any_file && o.log_dir.empty()) bad(app, "--redirects/--tee need --log-dir");
}

}  // namespace

Options parse_options(int argc, char** argv) {
  CLI::App app{
      "dtrain-run: start PROGRAM as several ranks per node, on one or more machines, and keep "
      "the job alive through failures. Accepts torchrun's flags; each worker gets torchrun's "
      "environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...).",
      "dtrain-run"};
  Options o;
  Typed t;
  declare_options(app, o, t);
  parse_command_line(app, argc, argv, o);
  check_sizes(app, t, o);
  apply_rdzv_conf(app, t.rdzv_conf, o);
  check_replicas(app, o);  // (before --standalone turns into a c10d rendezvous)
  check_rendezvous(app, t.nnodes, o);
  check_output(app, t, o);
  return o;
}

}  // namespace dtrain::run
