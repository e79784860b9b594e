// dtrain-run and signals: forwarded to the workers, no orphans left, a
// signal during the rendezvous or while waiting for other nodes, a node
// that died while joining.

#include <arpa/inet.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "harness/assertions.h"
#include "harness/process_ranks.h"
#include "launcher/launch.h"

namespace dtrain::testing {
namespace {

// Starts `dtrain-run ... probe sleep`, returns the launcher and the pids of
// its workers and their children.
std::vector<pid_t> start_sleepers(ProcessRanks& procs, RankProcess*& launcher) {
  launcher = &procs.spawn({kRun, "--nproc-per-node", "2", "--standalone", "--rdzv-conf",
                           "close_timeout=2", kProbe, "sleep"},
                          {});
  std::vector<pid_t> pids;
  auto deadline = Clock::now() + 30s;
  std::regex re("\\]:pids ([0-9]+) ([0-9]+)");
  while (Clock::now() < deadline && pids.size() < 4) {
    pids.clear();
    auto out = launcher->output();
    for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it) {
      pids.push_back(std::stoi((*it)[1]));
      pids.push_back(std::stoi((*it)[2]));
    }
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(pids.size(), 4u) << launcher->output();
  return pids;
}

TEST(Launcher, ForwardsSignalsAndLeavesNoOrphans) {
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT}) {
    ProcessRanks procs;
    RankProcess* launcher = nullptr;
    auto pids = start_sleepers(procs, launcher);
    for (pid_t p : pids) ASSERT_TRUE(alive(p));
    kill(launcher->pid, sig);
    ASSERT_TRUE(procs.wait(*launcher, Clock::now() + 20s)) << "launcher did not exit on " << sig;
    EXPECT_EQ(launcher->exit_code, 128 + sig) << launcher->output();
    for (pid_t p : pids) EXPECT_FALSE(alive(p)) << "process " << p << " survived signal " << sig;
  }
}

TEST(Launcher, WorkersDieWithAKilledLauncher) {
  ProcessRanks procs;
  RankProcess* launcher = nullptr;
  auto pids = start_sleepers(procs, launcher);
  kill(launcher->pid, SIGKILL);
  procs.wait(*launcher, Clock::now() + 10s);
  // Workers have PR_SET_PDEATHSIG; give the kernel a moment to deliver it.
  auto deadline = Clock::now() + 5s;
  while (Clock::now() < deadline && (alive(pids[0]) || alive(pids[2])))
    std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(alive(pids[0]));
  EXPECT_FALSE(alive(pids[2]));
  for (pid_t p : pids) kill(p, SIGKILL);  // the workers' own children are the program's business
}

// True once `pid` blocks SIGTERM (dtrain-run's signal watcher runs), read
// from /proc/<pid>/status.
bool wait_watching_signals(pid_t pid, Clock::time_point deadline) {
  const uint64_t bit = uint64_t{1} << (SIGTERM - 1);
  for (; Clock::now() < deadline; std::this_thread::sleep_for(20ms)) {
    std::ifstream status("/proc/" + std::to_string(pid) + "/status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("SigBlk:", 0) == 0 && (std::stoull(line.substr(7), nullptr, 16) & bit))
        return true;
  }
  return false;
}

// True once every child of `pid` has exited (gone, or a zombie the launcher
// has yet to reap).
bool wait_children_exited(pid_t pid, Clock::time_point deadline) {
  for (; Clock::now() < deadline; std::this_thread::sleep_for(20ms)) {
    bool child = false;
    if (DIR* proc = opendir("/proc")) {
      while (dirent* e = readdir(proc)) {
        std::ifstream stat(std::string("/proc/") + e->d_name + "/stat");
        std::string line;
        if (!std::getline(stat, line)) continue;
        // pid (comm) state ppid ...: comm may hold spaces and parentheses.
        const auto close = line.rfind(')');
        if (close == std::string::npos) continue;
        std::istringstream rest(line.substr(close + 1));
        std::string state;
        long ppid = 0;
        if (rest >> state >> ppid && ppid == pid && state != "Z") child = true;
      }
      closedir(proc);
    }
    if (!child) return true;
  }
  return false;
}

// True once something accepts connections on 127.0.0.1:port.
bool wait_listening(int port, Clock::time_point deadline) {
  for (; Clock::now() < deadline; std::this_thread::sleep_for(20ms)) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    close(fd);
    if (ok) return true;
  }
  return false;
}

// A signal stops the launcher in every phase, not only while workers run.
TEST(Launcher, SignalDuringTheRendezvousStopsItPromptly) {
  const std::string port = std::to_string(free_port());
  // node 0 waits for a node 1 that never comes; node 1 for a store not up.
  for (const auto& [node, phase] : std::vector<std::pair<std::string, std::string>>{
           {"0", "during the rendezvous"}, {"1", "while connecting to the rendezvous store"}}) {
    ProcessRanks procs;
    auto& p = procs.spawn({kRun, "--nnodes", "2", "--node-rank", node, "--master-port", port,
                           kProbe, "env"},
                          {});
    // The launcher takes signals only once it is running: under load, loading
    // libtorch alone can take seconds. Wait until it watches them, and node 0
    // until its store listens (it is then in the rendezvous).
    ASSERT_TRUE(wait_watching_signals(p.pid, Clock::now() + 30s)) << p.output();
    if (node == "0") ASSERT_TRUE(wait_listening(std::stoi(port), Clock::now() + 30s));
    std::this_thread::sleep_for(500ms);
    const auto sent = Clock::now();
    kill(p.pid, SIGTERM);
    ASSERT_TRUE(procs.wait(p, Clock::now() + 20s)) << "node " << node << " ignored SIGTERM";
    EXPECT_LT(Clock::now() - sent, 5s);
    EXPECT_EQ(p.signal, 0) << "node " << node << " died of signal " << p.signal;
    EXPECT_EQ(p.exit_code, 128 + SIGTERM) << p.output();
    EXPECT_TRUE(Contains(p.output(), "dtrain-run: received SIGTERM " + phase)) << p.output();
    EXPECT_TRUE(Contains(p.output(), "dtrain-run: job stopped by SIGTERM; exit code 143"));
  }
}

// A library loaded with the launcher may start threads before main() can
// block anything (OpenBLAS does, sized by OMP_NUM_THREADS): a SIGTERM that
// the kernel hands to such a thread must still stop the launcher in order,
// not end it silently with the default action. Without the handler this
// failed every time: the launcher died of SIGTERM, printing nothing.
TEST(Launcher, SignalTakenByALibrarysEarlyThreadStillStopsTheLauncherInOrder) {
  const std::string port = std::to_string(free_port());
  ProcessRanks procs;
  auto& p = procs.spawn({kRun, "--nnodes", "2", "--node-rank", "1", "--master-port", port, kProbe,
                         "env"},
                        {{"LD_PRELOAD", EARLY_THREAD_LIBRARY}});
  ASSERT_TRUE(wait_watching_signals(p.pid, Clock::now() + 30s)) << p.output();
  kill(p.pid, SIGTERM);
  ASSERT_TRUE(procs.wait(p, Clock::now() + 20s)) << "the launcher ignored SIGTERM";
  EXPECT_EQ(p.signal, 0) << "the launcher died of signal " << p.signal;
  EXPECT_EQ(p.exit_code, 128 + SIGTERM) << p.output();
  EXPECT_TRUE(Contains(p.output(),
                       "dtrain-run: received SIGTERM while connecting to the rendezvous store"))
      << p.output();
}

// A node that took a place in the round (its count) but died before it
// wrote its address: the others wait for the node table no longer than the
// join timeout, and a signal stops that wait at once (issue 30 item 8).
TEST(Launcher, ANodeThatDiedWhileJoiningCostsAtMostTheJoinTimeoutAndASignalStopsTheWait) {
  for (const bool signal : {true, false}) {
    const std::string port = std::to_string(free_port());
    const std::string id = signal ? "node-table-signal" : "node-table-timeout";
    ProcessRanks procs;
    auto& run = procs.spawn({kRun, "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                             "127.0.0.1:" + port, "--rdzv-id", id, "--rdzv-conf",
                             signal ? "join_timeout=120" : "join_timeout=3", kProbe, "env"},
                            {});
    ASSERT_TRUE(wait_watching_signals(run.pid, Clock::now() + 30s)) << run.output();
    ASSERT_TRUE(wait_listening(std::stoi(port), Clock::now() + 30s)) << run.output();
    auto& ghost = procs.spawn({kProbe, "take-place", port, id}, {});
    ASSERT_TRUE(procs.wait(ghost, Clock::now() + 30s)) << ghost.output();
    ASSERT_TRUE(Contains(ghost.output(), "took place 1")) << ghost.output();
    const auto since = Clock::now();
    if (signal) {
      std::this_thread::sleep_for(500ms);  // the launcher is reading the node table now
      kill(run.pid, SIGTERM);
    }
    ASSERT_TRUE(procs.wait(run, Clock::now() + 30s)) << "the launcher still waits: " << run.output();
    if (signal) {
      EXPECT_LT(Clock::now() - since, 5s);
      EXPECT_EQ(run.exit_code, 128 + SIGTERM) << run.output();
      EXPECT_TRUE(Contains(run.output(), "dtrain-run: received SIGTERM during the rendezvous; exiting"));
    } else {
      EXPECT_LT(Clock::now() - since, 15s);
      EXPECT_EQ(run.exit_code, 1) << run.output();
      EXPECT_TRUE(Contains(run.output(), "dtrain-run: rendezvous '" + id + "' at 127.0.0.1:" + port +
                                             " (round 0): node(s) 1 took a place in the round but "
                                             "did not write their address within 3 s (did their "
                                             "launchers die while joining?)"));
    }
  }
}

// Restarts leave the store holding two rounds of rendezvous keys, not all
// of them: when round N forms, round N-2's keys (node table, keep-alives,
// its end and count) are gone, round N-1's still there (issue 30 item 15).
TEST(Launcher, RestartsDeleteTheKeysOfRoundsNoNodeNeeds) {
  auto r = launch({"--nproc-per-node", "1", "--max-restarts", "3", "--master-port",
                   std::to_string(free_port()), kProbe, "rdzv-keys", "3"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, "[0]:attempt 1 round 0: node/0 failed counted"));
  EXPECT_TRUE(Contains(r.output, "[0]:attempt 2 round 0: (none)\n"));
  EXPECT_TRUE(Contains(r.output, "[0]:attempt 2 round 1: node/0 failed counted"));
  EXPECT_TRUE(Contains(r.output, "[0]:attempt 3 round 0: (none)\n"));
  EXPECT_TRUE(Contains(r.output, "[0]:attempt 3 round 1: (none)\n"));
  EXPECT_TRUE(Contains(r.output, "[0]:attempt 3 round 2: node/0 failed counted"));
}

TEST(Launcher, SignalWhileWaitingForTheOtherNodesStopsPromptly) {
  const std::string port = std::to_string(free_port());
  ProcessRanks procs;
  auto& node0 = procs.spawn({kRun, "--nnodes", "2", "--node-rank", "0", "--master-port", port,
                             kProbe, "env"},
                            {});
  auto& node1 = procs.spawn({kRun, "--nnodes", "2", "--node-rank", "1", "--master-port", port,
                             kProbe, "sleep"},
                            {});
  const auto deadline = Clock::now() + 30s;  // node 0's workers are done; node 1's sleep
  while (Clock::now() < deadline && !Contains(node0.output(), "[0]:env RANK=0"))
    std::this_thread::sleep_for(50ms);
  // The worker printed; under load its exit can take longer than any fixed
  // pause. Signal only once it has exited.
  ASSERT_TRUE(wait_children_exited(node0.pid, deadline)) << node0.output();
  std::this_thread::sleep_for(200ms);
  const auto sent = Clock::now();
  kill(node0.pid, SIGTERM);
  ASSERT_TRUE(procs.wait(node0, Clock::now() + 20s)) << node0.output();
  EXPECT_LT(Clock::now() - sent, 5s);
  EXPECT_EQ(node0.exit_code, 128 + SIGTERM) << node0.output();
  EXPECT_TRUE(Contains(node0.output(),
                       "received SIGTERM while waiting for the other nodes to finish"));
  kill(node1.pid, SIGTERM);
  procs.wait(node1, Clock::now() + 20s);
}

}  // namespace
}  // namespace dtrain::testing
