// The per-node agent: rendezvous, start workers, watch them and the other
// nodes, and on a failure stop everything and go to the next round while
// the job's restart budget lasts.

#include "agent.h"

#include <signal.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iostream>
#include <sstream>

#include "common/env.h"
#include "dtrain/checkpoint/snapshot_keeper.h"
#include "dtrain/errors.h"
#include "error_file.h"
#include "rendezvous.h"
#include "signals.h"
#include "timeline_merge.h"
#include "worker_group.h"

extern char** environ;

namespace dtrain::run {
namespace {

std::string timestamp(std::chrono::system_clock::time_point t) {
  std::time_t tt = std::chrono::system_clock::to_time_t(t);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", std::localtime(&tt));
  return buf;
}

std::vector<WorkerSpec> worker_specs(const Options& o, const Round& r, const ErrorFiles& errors,
                                     const std::string& snapshot_socket) {
  // The launcher's environment, minus what we set, plus torchrun's contract.
  std::vector<std::string> base;
  bool user_omp = false;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    if (kv.rfind("OMP_NUM_THREADS=", 0) == 0) user_omp = true;
    base.push_back(kv);
  }
  std::vector<WorkerSpec> specs;
  for (int lr = 0; lr < o.nproc_per_node; ++lr) {
    const int rank = r.rank_offset + lr;
    std::vector<std::pair<std::string, std::string>> vars = {
        {"RANK", std::to_string(rank)},
        {"LOCAL_RANK", std::to_string(lr)},
        {"GROUP_RANK", std::to_string(r.node_rank)},
        {"ROLE_RANK", std::to_string(rank)},
        {"ROLE_NAME", o.role},
        {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
        {"WORLD_SIZE", std::to_string(r.world_size)},
        {"GROUP_WORLD_SIZE", std::to_string(r.nnodes)},
        {"ROLE_WORLD_SIZE", std::to_string(r.world_size)},
        {"MASTER_ADDR", r.master_addr},
        {"MASTER_PORT", std::to_string(r.master_port)},
        {"TORCHELASTIC_RESTART_COUNT", std::to_string(r.number)},
        {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts)},
        {"TORCHELASTIC_RUN_ID", o.rdzv_id},
        {"TORCHELASTIC_USE_AGENT_STORE", "True"},  // MASTER_PORT is this launcher's store
        {"DTRAIN_LAUNCHER", "dtrain-run"},  // ... which speaks dtrain's protocol too
    };
    if (!user_omp && o.nproc_per_node > 1) vars.push_back({"OMP_NUM_THREADS", "1"});
    if (!snapshot_socket.empty()) vars.push_back({env::kSnapshotSocket.name, snapshot_socket});
    // The worker's stdout is our pipe; tell it when its lines reach a terminal.
    const bool shown = o.shown(lr) && !(static_cast<int>(o.redirect_of(lr)) & 1);
    vars.push_back({"DTRAIN_TTY", shown && isatty(STDOUT_FILENO) ? "1" : "0"});
    const std::string error_file = errors.prepare(r.number, lr);
    if (!error_file.empty()) vars.push_back({"TORCHELASTIC_ERROR_FILE", error_file});
    WorkerSpec spec{lr, rank, {}, error_file};
    for (const auto& kv : base) {
      const auto name = kv.substr(0, kv.find('='));
      bool overridden = false;
      for (const auto& [k, v] : vars) overridden = overridden || k == name;
      if (!overridden) spec.env.push_back(kv);
    }
    for (const auto& [k, v] : vars) spec.env.push_back(k + "=" + v);
    specs.push_back(std::move(spec));
  }
  return specs;
}

// What the failed worker's error file says, indented for the summary; ""
// when it wrote none.
std::string root_cause(const WorkerExit& f) {
  if (f.error_file.empty()) return "";
  const auto report = read_error_file(f.error_file);
  if (!report) return "";
  if (!report->problem.empty())
    return "  its error file " + f.error_file + " could not be used: " + report->problem + "\n";
  std::string out = "  root cause (its error file " + f.error_file + "):\n    ";
  for (char c : report->message) out += c == '\n' ? std::string("\n    ") : std::string(1, c);
  return out + "\n";
}

// The first line of the error file's message, short, for the other nodes.
std::string cause_in_brief(const WorkerExit& f) {
  if (f.error_file.empty()) return "";
  const auto report = read_error_file(f.error_file);
  if (!report || !report->problem.empty() || report->message.empty()) return "";
  std::string line = report->message.substr(0, report->message.find('\n'));
  if (line.size() > 300) line = line.substr(0, 300) + "...";
  return ": " + line;
}

void print_summary(const Options& o, const Round& r, int restarts_used, const WorkerExit& f,
                   const std::vector<std::string>& lines) {
  std::ostringstream out;
  out << "dtrain-run: job failed (attempt " << r.number << ", " << restarts_used << "/" << o.max_restarts
      << " restarts used)\n"
      << "  rank " << f.rank << " (local rank " << f.local_rank << " on node " << r.node_rank
      << ", pid " << f.pid << ") " << f.describe() << " at " << timestamp(f.when) << "\n"
      << root_cause(f);
  if (!lines.empty()) {
    out << "  its last " << lines.size() << " line(s):\n";
    for (const auto& l : lines) out << "    " << l << "\n";
  }
  std::cerr << out.str() << std::flush;
}

// A signal stopped the launcher in `phase`: the workers (if any) get the
// signal, then SIGKILL after close_timeout; the other nodes learn why.
int stop_for_signal(const Options& o, const Round* round, Rendezvous* rdzv, WorkerGroup* group,
                    int sig, const char* phase) {
  std::cerr << "dtrain-run: received " << signal_name(sig) << " " << phase
            << (group ? "; stopping the workers" : "; exiting") << std::endl;
  if (group) group->stop(sig, o.close_timeout);
  if (round && rdzv) {
    try {
      rdzv->report_failure(*round, "node " + std::to_string(round->node_rank) +
                                       "'s launcher received " + signal_name(sig));
    } catch (...) {
    }
  }
  std::cerr << "dtrain-run: job stopped by " << signal_name(sig)
            << (round ? " (attempt " + std::to_string(round->number) + ")" : std::string())
            << "; exit code " << 128 + sig << std::endl;
  return 128 + sig;
}

// This node's workers succeeded: the store's host waits for the others.
int finish_succeeded(const Options& o, Rendezvous& rdzv, const Round& round) {
  rdzv.report_done(round);
  if (!rdzv.hosts_store()) return 0;
  try {
    if (!rdzv.wait_for_others(round)) {
      std::cerr << "dtrain-run: this node's workers finished, but another node failed"
                << std::endl;
      return 1;
    }
  } catch (const Interrupted& e) {
    return stop_for_signal(o, &round, &rdzv, nullptr, e.signal,
                           "while waiting for the other nodes to finish");
  }
  return 0;
}

// With DTRAIN_TRACE_DIR set (workers inherit it), a failed round's
// surviving workers write their flight recorders there before they are
// stopped, and the failed ones' error files are copied there
// (error-R.json); says where they are and how to read them.
void collect_traces(WorkerGroup& group) {
  const char* dir = std::getenv("DTRAIN_TRACE_DIR");
  if (!dir || !*dir) return;
  const auto ranks = group.collect_traces(dir, std::chrono::seconds(3));
  group.copy_error_notes(dir);
  std::ostringstream list;
  for (size_t i = 0; i < ranks.size(); ++i) list << (i ? ", " : "") << ranks[i];
  std::cerr << "dtrain-run: flight recorder dumps of this node's "
            << (ranks.size() == 1 ? "rank " : "ranks ") << (ranks.empty() ? "(none)" : list.str())
            << " are in " << dir << "; read them with: dtrain-trace analyze " << dir << std::endl;
}

// DTRAIN_TIMELINE: merges this node's workers' timelines into one file.
void merge_timelines(const WorkerGroup& group) {
  const char* path = std::getenv("DTRAIN_TIMELINE");
  if (!path || !*path) return;
  try {
    const auto merged = merge_timeline(path, group.ranks());
    std::cerr << "dtrain-run: timeline of " << merged.size() << " rank"
              << (merged.size() == 1 ? "" : "s") << " written to " << path
              << " (open it in ui.perfetto.dev or chrome://tracing)" << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "dtrain-run: DTRAIN_TIMELINE: " << e.what() << std::endl;
  }
}

// What happens after a round ended early, its workers stopped: the job
// fails (1) when the restart budget is spent, or the nodes meet again (-1).
// A scale-up uses no restart.
int after_round(const Options& o, Rendezvous& rdzv, const Round& round, WorkerGroup& group,
                const WorkerExit& failure, const RoundEnd& end, bool local_failure) {
  if (end.scale_up) {
    std::cerr << "dtrain-run: " << end.reason << "; stopped this node's workers to meet again with "
              << "them in round " << round.number + 1 << " (no restart used)" << std::endl;
    return -1;
  }
  if (!local_failure) std::cerr << "dtrain-run: stopping this node's workers: " << end.reason << std::endl;
  int used = 0;
  try {
    used = rdzv.restarts_used();
  } catch (const std::exception& e) {
    std::cerr << "dtrain-run: lost the rendezvous store " << rdzv.endpoint() << ": " << e.what() << std::endl;
    return 1;
  }
  if (used >= o.max_restarts) {
    if (local_failure) print_summary(o, round, used, failure, group.last_lines(failure.local_rank));
    else std::cerr << "dtrain-run: job failed, no restarts left (" << end.reason << ")" << std::endl;
    return 1;
  }
  if (local_failure)
    std::cerr << "dtrain-run: rank " << failure.rank << " (local rank " << failure.local_rank << ") "
              << failure.describe() << "\n" << root_cause(failure) << std::flush;
  std::cerr << "dtrain-run: restarting the workers (restart " << used + 1 << " of " << o.max_restarts
            << ")" << std::endl;
  return -1;
}

// Runs one round's workers until they succeed (0), the job must end
// (its exit code), or the round ended and the nodes meet again (-1).
int run_round(const Options& o, Rendezvous& rdzv, const Round& round, const ErrorFiles& errors,
              const std::string& snapshot_socket) {
  WorkerGroup group(o, round.number);
  WorkerExit failure;
  RoundEnd end;
  bool local_failure = false;
  try {
    group.start(worker_specs(o, round, errors, snapshot_socket));
    for (;;) {
      if (int sig = wait_signal(o.monitor_interval))
        return stop_for_signal(o, &round, &rdzv, &group, sig, "while the workers ran");
      auto state = group.poll(&failure);
      if (state == WorkerGroup::State::Succeeded) {
        merge_timelines(group);
        return finish_succeeded(o, rdzv, round);
      }
      if (state == WorkerGroup::State::Failed) {
        std::ostringstream why;
        why << "rank " << failure.rank << " on node " << round.node_rank << " "
            << failure.describe() << " at " << timestamp(failure.when) << cause_in_brief(failure);
        // Unless the round already ended (a scale-up stopping peers makes
        // workers fail), this failure ends it.
        end = rdzv.report_failure(round, why.str());
        local_failure = !end.scale_up;
        break;
      }
      if (auto ended = rdzv.check(round)) {
        end = *ended;
        break;
      }
    }
  } catch (const Interrupted& e) {  // while starting the workers
    return stop_for_signal(o, &round, &rdzv, &group, e.signal, "while starting the workers");
  } catch (const std::exception& e) {
    // Spawn failures, or the store vanished (its host node is gone).
    group.stop(SIGTERM, o.close_timeout);
    std::cerr << "dtrain-run: " << e.what() << std::endl;
    try {
      rdzv.report_failure(round, "node " + std::to_string(round.node_rank) + ": " + e.what());
    } catch (...) {
    }
    return 1;
  }
  if (!end.scale_up) collect_traces(group);
  group.stop(SIGTERM, o.close_timeout);
  merge_timelines(group);
  if (int sig = pending_signal())  // arrived while the workers were being stopped
    return stop_for_signal(o, &round, &rdzv, &group, sig, "while stopping the workers");
  return after_round(o, rdzv, round, group, failure, end, local_failure);
}

}  // namespace

int run_agent(const Options& o) {
  // Signals are taken by one watcher thread (signals.h); start it before
  // any other thread exists so every thread inherits the blocked mask.
  start_signal_watch();
  // Orphans of our workers (their own children) are re-parented to us, so
  // stopping a worker group can kill and reap them too.
  prctl(PR_SET_CHILD_SUBREAPER, 1);

  const ErrorFiles errors(o);  // for the launcher's lifetime: removed after the summary
  // checkpoint::snapshot()'s parts, held here so that a restart of the
  // workers keeps them; gone when the launcher exits.
  std::unique_ptr<checkpoint::SnapshotKeeper> keeper;
  try {
    const char* tmp = std::getenv("TMPDIR");  // dtrain-run's scratch space, as error_file.cpp's
    keeper = std::make_unique<checkpoint::SnapshotKeeper>(checkpoint::SnapshotKeeper::default_memory_limit(),
                                                          tmp ? tmp : "");
  } catch (const InvalidArgument& e) {
    std::cerr << "dtrain-run: " << e.what() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "dtrain-run: no snapshots in memory for this job: " << e.what() << std::endl;
  }
  std::unique_ptr<Rendezvous> rdzv;
  int attempt = 0;
  try {
    rdzv = std::make_unique<Rendezvous>(o);
    attempt = rdzv->current_round();
  } catch (const Interrupted& e) {
    return stop_for_signal(o, nullptr, nullptr, nullptr, e.signal,
                           "while connecting to the rendezvous store");
  } catch (const std::exception& e) {
    std::cerr << "dtrain-run: " << (rdzv ? "rendezvous store " + rdzv->endpoint() + ": " : "")
              << e.what() << std::endl;
    return 1;
  }
  for (;; ++attempt) {
    try {
      if (rdzv->restarts_used() > o.max_restarts) {
        std::cerr << "dtrain-run: the job has used all of its " << o.max_restarts
                  << " restart(s); not starting again" << std::endl;
        return 1;
      }
    } catch (const std::exception& e) {
      std::cerr << "dtrain-run: lost the rendezvous store " << rdzv->endpoint() << ": " << e.what()
                << std::endl;
      return 1;
    }
    Round round;
    try {
      round = rdzv->join(attempt);
    } catch (const Interrupted& e) {
      return stop_for_signal(o, nullptr, nullptr, nullptr, e.signal, "during the rendezvous");
    } catch (const std::exception& e) {
      std::cerr << "dtrain-run: " << e.what() << std::endl;
      return 1;
    }
    attempt = round.number;  // a late node joins a later round than it asked for
    const int rc = run_round(o, *rdzv, round, errors, keeper ? keeper->socket_path() : std::string());
    if (rc >= 0) return rc;
    try {
      rdzv->advance(attempt);
    } catch (const std::exception& e) {
      std::cerr << "dtrain-run: lost the rendezvous store " << rdzv->endpoint() << ": "
                << e.what() << std::endl;
      return 1;
    }
  }
}

}  // namespace dtrain::run
