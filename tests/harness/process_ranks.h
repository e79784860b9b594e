#pragma once

// Runs ranks as real processes (gloo's multiproc_test.h pattern): for real
// TCP stores, bad environments, and peers killed or stopped with signals.
// Each rank's stdout+stderr goes to a file that the test reads back.

#include <sys/types.h>

#include <chrono>
#include <deque>
#include <map>
#include <string>
#include <vector>

namespace dtrain::testing {

struct RankProcess {
  pid_t pid = -1;
  std::string log_path;
  int exit_code = -1;  // valid when exited
  int signal = 0;      // set when killed by a signal
  bool exited = false;
  std::chrono::steady_clock::time_point end;
  std::string output() const;
};

// "exit N signal S" and the process's output, for a failing assertion.
std::string describe(const RankProcess& p);

// A port that was free a moment ago on 127.0.0.1.
int free_port();

// A listening socket on 127.0.0.1 that nobody answers: its port is "in use".
class HeldPort {
 public:
  HeldPort();
  ~HeldPort();
  HeldPort(const HeldPort&) = delete;
  HeldPort& operator=(const HeldPort&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

class ProcessRanks {
 public:
  // argv[0] is the program; env adds to (and overrides) this environment.
  RankProcess& spawn(const std::vector<std::string>& argv,
                     const std::map<std::string, std::string>& env);
  // Waits until `p` exits or the deadline; false on timeout.
  bool wait(RankProcess& p, std::chrono::steady_clock::time_point deadline);
  // Waits for every process; those still alive at the deadline are killed
  // and reported as a failure by the caller (returns false).
  bool wait_all(std::chrono::milliseconds timeout);
  // Waits until the log of `p` contains `text` (or the process exits).
  bool wait_for_output(RankProcess& p, const std::string& text, std::chrono::milliseconds timeout);
  std::deque<RankProcess>& ranks() { return procs_; }
  ~ProcessRanks();  // kills and reaps whatever is left: no orphans

 private:
  std::deque<RankProcess> procs_;
};

std::map<std::string, std::string> rank_env(int rank, int world, int port,
                                            const std::string& timeout_s = "30");

}  // namespace dtrain::testing
