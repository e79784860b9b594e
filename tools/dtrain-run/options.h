#pragma once

// dtrain-run's command line: torchrun's flags with torchrun's meanings
// (dashed and underscored spellings, and PET_<FLAG> environment aliases).

#include <chrono>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtrain::run {

// Where each local rank's stdout/stderr goes (torchrun's Std values).
enum class Std { None = 0, Out = 1, Err = 2, All = 3 };

struct Options {
  int nproc_per_node = 1;
  int min_nodes = 1, max_nodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool standalone = false;
  std::string rdzv_backend = "static";
  std::string rdzv_endpoint;  // host[:port]
  std::string rdzv_host;
  int rdzv_port = 29400;
  std::string rdzv_id = "none";
  std::chrono::milliseconds join_timeout{600000}, last_call_timeout{30000}, close_timeout{30000};
  std::chrono::milliseconds keep_alive_interval{5000};
  int keep_alive_max_attempt = 3;
  int max_restarts = 0;
  std::chrono::milliseconds monitor_interval{100};
  std::string role = "default";
  std::string log_dir;
  std::map<int, Std> redirects, tee;  // by local rank; -1 = every rank
  std::vector<int> local_ranks_filter;  // empty: all
  std::string local_addr;
  bool keep_stdin = false;  // workers read the launcher's stdin (else /dev/null)
  int replicas = 0;  // > 0: that many replica groups of a fault-tolerant job on this node (replicas.h)
  std::vector<std::string> launcher_args;  // the launcher's flags as typed (what a replica's launcher gets)
  std::string program;
  std::vector<std::string> args;

  bool elastic() const { return rdzv_backend == "c10d"; }
  Std redirect_of(int local_rank) const;
  Std tee_of(int local_rank) const;
  bool shown(int local_rank) const;
};

// What parse_options() has to say instead of Options: the usage (--help,
// exit code 0, for stdout) or an error naming the bad flag or value
// followed by the usage (exit code 2, for stderr).
struct UsageError : std::runtime_error {
  UsageError(int code, const std::string& text) : std::runtime_error(text), exit_code(code) {}
  int exit_code;
};

// Parses argv; throws UsageError for --help and for bad input.
Options parse_options(int argc, char** argv);

}  // namespace dtrain::run
