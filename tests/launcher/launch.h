#pragma once

// Runs dtrain-run (or a shell line around it) as a test's child process and
// collects how it ended.

#include <signal.h>

#include <chrono>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "harness/process_ranks.h"

namespace dtrain::testing {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

inline const std::string kRun = DTRAIN_RUN_EXECUTABLE;
inline const std::string kProbe = PROBE_EXECUTABLE;

struct Result {
  int exit_code;
  int signal;
  std::string output;
  Clock::duration took;
};

inline Result launch(std::vector<std::string> args, std::chrono::seconds timeout = 60s) {
  args.insert(args.begin(), kRun);
  ProcessRanks procs;
  auto start = Clock::now();
  auto& p = procs.spawn(args, {{"OMP_NUM_THREADS", "1"}});
  bool done = procs.wait(p, Clock::now() + timeout);
  EXPECT_TRUE(done) << "dtrain-run did not finish: " << p.output();
  return {p.exit_code, p.signal, p.output(), Clock::now() - start};
}

inline bool alive(pid_t pid) { return kill(pid, 0) == 0; }

// Runs a bash command line (for launcher runs that need a pipe as stdin).
inline Result launch_shell(const std::string& cmd, std::chrono::seconds timeout = 60s) {
  ProcessRanks procs;
  auto start = Clock::now();
  auto& p = procs.spawn({"/bin/bash", "-c", cmd}, {{"OMP_NUM_THREADS", "1"}});
  bool done = procs.wait(p, Clock::now() + timeout);
  EXPECT_TRUE(done) << "did not finish: " << p.output();
  return {p.exit_code, p.signal, p.output(), Clock::now() - start};
}

}  // namespace dtrain::testing
