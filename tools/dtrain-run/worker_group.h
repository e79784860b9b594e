#pragma once

// The workers of one node for one attempt: started in their own process
// groups (so a signal reaches a worker's children too), watched with
// waitpid, their output prefixed with the rank and/or written to log files,
// and stopped with a signal, a grace period, then SIGKILL. Workers also get
// PR_SET_PDEATHSIG, so even a launcher killed with SIGKILL leaves no orphans.

#include <sys/types.h>

#include <chrono>
#include <deque>
#include <memory>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "options.h"

namespace dtrain::run {

struct WorkerSpec {
  int local_rank;
  int rank;
  std::vector<std::string> env;  // KEY=VALUE, the whole environment
  std::string error_file;        // its TORCHELASTIC_ERROR_FILE ("" when none)
};

struct WorkerExit {
  int local_rank = -1, rank = -1;
  pid_t pid = -1;
  int code = 0;    // exit code when exited normally
  int signal = 0;  // signal number when killed
  std::chrono::system_clock::time_point when;
  std::vector<std::string> last_lines;
  std::string error_file;  // where it may have said why ("" when none)
  std::string describe() const;  // "exited with code 3" / "killed by SIGKILL"
};

class WorkerGroup {
 public:
  enum class State { Running, Succeeded, Failed };

  WorkerGroup(const Options& options, int attempt);
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Throws std::runtime_error when a worker cannot be started.
  void start(const std::vector<WorkerSpec>& specs);
  // Notes finished workers (left unreaped, so that their pids, and so their
  // process-group ids, cannot be reused before stop()); on the first failure
  // fills `failure`.
  State poll(WorkerExit* failure);
  // Sends `sig` to every worker's process group, waits up to `grace`, then
  // SIGKILLs what is left and reaps everything. Bounded: a process that
  // will not die even of SIGKILL, or a grandchild that keeps an output pipe
  // open, costs at most a few seconds more, never a hang.
  void stop(int sig, std::chrono::milliseconds grace);
  // The flight recorder after a failure: sends SIGUSR2 to every worker
  // still running (dtrain writes its dump to `dir` on it), waits up to
  // `wait` for their dumps, and returns the ranks with a dump in `dir`.
  std::vector<int> collect_traces(const std::string& dir, std::chrono::milliseconds wait);
  // What the failed workers' error files say, copied to `dir` as
  // error-<rank>.json for dtrain-trace (a rank that died before its dump
  // was complete still says where it failed); returns their ranks.
  std::vector<int> copy_error_notes(const std::string& dir);
  // The global ranks of this node's workers.
  std::vector<int> ranks() const;
  // The last lines a worker printed (complete once stop() has returned).
  std::vector<std::string> last_lines(int local_rank);

 private:
  struct Worker;
  void pump(Worker& w, int fd, bool is_stderr);
  bool note_exit(Worker& w);
  // Pumps stop reading at this time (steady clock, ns); set by stop().
  std::atomic<int64_t> pump_deadline_ns_{INT64_MAX};
  const Options& options_;
  int attempt_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::mutex console_mutex_;
};

}  // namespace dtrain::run
