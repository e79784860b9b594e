// The per-node agent: rendezvous, start workers, watch them and the other
// nodes, and on a failure stop everything and go to the next round while
// the job's restart budget lasts.

#include "agent.h"

#include <signal.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <cstring>
#include <ctime>
#include <iostream>
#include <sstream>

#include "dtrain/errors.h"
#include "rendezvous.h"
#include "worker_group.h"

extern char** environ;

namespace dtrain::run {
namespace {

const int kForwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

std::string timestamp(std::chrono::system_clock::time_point t) {
  std::time_t tt = std::chrono::system_clock::to_time_t(t);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", std::localtime(&tt));
  return buf;
}

std::vector<WorkerSpec> worker_specs(const Options& o, const Round& r) {
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
        {"TORCHELASTIC_USE_AGENT_STORE", "False"},  // workers host their own store
    };
    if (!user_omp && o.nproc_per_node > 1) vars.push_back({"OMP_NUM_THREADS", "1"});
    // The worker's stdout is our pipe; tell it when its lines reach a terminal.
    const bool shown = o.shown(lr) && !(static_cast<int>(o.redirect_of(lr)) & 1);
    vars.push_back({"DTRAIN_TTY", shown && isatty(STDOUT_FILENO) ? "1" : "0"});
    WorkerSpec spec{lr, rank, {}};
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

void print_summary(const Options& o, const Round& r, const WorkerExit& f,
                   const std::vector<std::string>& lines) {
  std::ostringstream out;
  out << "dtrain-run: job failed (attempt " << r.number << ", " << r.number << "/" << o.max_restarts
      << " restarts used)\n"
      << "  rank " << f.rank << " (local rank " << f.local_rank << " on node " << r.node_rank
      << ", pid " << f.pid << ") " << f.describe() << " at " << timestamp(f.when) << "\n";
  if (!lines.empty()) {
    out << "  its last " << lines.size() << " line(s):\n";
    for (const auto& l : lines) out << "    " << l << "\n";
  }
  std::cerr << out.str() << std::flush;
}

// Waits up to `timeout` for a forwarded signal; returns it or 0.
int wait_signal(std::chrono::milliseconds timeout) {
  sigset_t set;
  sigemptyset(&set);
  for (int s : kForwarded) sigaddset(&set, s);
  timespec ts{static_cast<time_t>(timeout.count() / 1000),
              static_cast<long>((timeout.count() % 1000) * 1000000)};
  int sig = sigtimedwait(&set, nullptr, &ts);
  return sig > 0 ? sig : 0;
}

}  // namespace

int run_agent(const Options& o) {
  // Signals are taken synchronously in the monitor loop (sigtimedwait);
  // block them before any thread exists so every thread inherits the mask.
  sigset_t set;
  sigemptyset(&set);
  for (int s : kForwarded) sigaddset(&set, s);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  // Orphans of our workers (their own children) are re-parented to us, so
  // stopping a worker group can kill and reap them too.
  prctl(PR_SET_CHILD_SUBREAPER, 1);

  std::unique_ptr<Rendezvous> rdzv;
  try {
    rdzv = std::make_unique<Rendezvous>(o);
  } catch (const std::exception& e) {
    std::cerr << "dtrain-run: " << e.what() << std::endl;
    return 1;
  }
  int attempt = 0;
  try {
    attempt = rdzv->current_round();
  } catch (const std::exception& e) {
    std::cerr << "dtrain-run: rendezvous store " << rdzv->endpoint() << ": " << e.what() << std::endl;
    return 1;
  }
  for (;;) {
    if (attempt > o.max_restarts) {
      std::cerr << "dtrain-run: the job has used all of its " << o.max_restarts
                << " restart(s); not starting again" << std::endl;
      return 1;
    }
    Round round;
    try {
      round = rdzv->join(attempt);
    } catch (const std::exception& e) {
      std::cerr << "dtrain-run: " << e.what() << std::endl;
      return 1;
    }
    WorkerGroup group(o, attempt);
    WorkerExit failure;
    std::string remote;
    int signal = 0;
    try {
      group.start(worker_specs(o, round));
      for (;;) {
        signal = wait_signal(o.monitor_interval);
        if (signal) break;
        auto state = group.poll(&failure);
        if (state == WorkerGroup::State::Succeeded) {
          rdzv->report_done(round);
          if (rdzv->hosts_store() && !rdzv->wait_for_others(round)) {
            std::cerr << "dtrain-run: this node's workers finished, but another node failed"
                      << std::endl;
            return 1;
          }
          return 0;
        }
        if (state == WorkerGroup::State::Failed) {
          std::ostringstream why;
          why << "rank " << failure.rank << " on node " << round.node_rank << " "
              << failure.describe() << " at " << timestamp(failure.when);
          rdzv->report_failure(round, why.str());
          break;
        }
        if (auto reason = rdzv->check(round)) {
          remote = *reason;
          break;
        }
      }
    } catch (const std::exception& e) {
      // Spawn failures, or the store vanished (its host node is gone).
      group.stop(SIGTERM, o.close_timeout);
      std::cerr << "dtrain-run: " << e.what() << std::endl;
      try {
        rdzv->report_failure(round, std::string("node ") + std::to_string(round.node_rank) + ": " + e.what());
      } catch (...) {
      }
      return 1;
    }
    if (signal) {
      std::cerr << "dtrain-run: received SIG" << sigabbrev_np(signal)
                << "; stopping the workers" << std::endl;
      group.stop(signal, o.close_timeout);
      try {
        rdzv->report_failure(round, "node " + std::to_string(round.node_rank) +
                                        "'s launcher received SIG" + sigabbrev_np(signal));
      } catch (...) {
      }
      return 128 + signal;
    }
    group.stop(SIGTERM, o.close_timeout);
    if (!remote.empty())
      std::cerr << "dtrain-run: stopping this node's workers: " << remote << std::endl;
    if (attempt >= o.max_restarts) {
      if (remote.empty()) print_summary(o, round, failure, group.last_lines(failure.local_rank));
      else std::cerr << "dtrain-run: job failed, no restarts left (" << remote << ")" << std::endl;
      return 1;
    }
    std::cerr << "dtrain-run: restarting the workers (restart " << attempt + 1 << " of "
              << o.max_restarts << ")" << std::endl;
    try {
      rdzv->advance(attempt);
    } catch (const std::exception& e) {
      std::cerr << "dtrain-run: lost the rendezvous store " << rdzv->endpoint() << ": " << e.what()
                << std::endl;
      return 1;
    }
    ++attempt;
  }
}

}  // namespace dtrain::run
