// Fault tolerance as a user runs it: dtrain-lighthouse and three replica
// groups of two ranks, each under its own dtrain-run, training
// dtrain-ft-fashion-mnist; one replica's workers all die by SIGKILL and are
// restarted by their launcher.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "harness/process_ranks.h"
#include "harness/temp_dir.h"

namespace dtrain::testing {
namespace {

using namespace std::chrono_literals;

// "<step> <hash> <unix ms> <first sample> <samples> <members>" lines of a
// replica's commit log (a line cut by a kill is dropped).
struct Commit {
  std::string hash;
  int64_t ms = 0, first = 0, count = 0;
};
std::map<int64_t, Commit> commits_of(const std::string& path) {
  std::map<int64_t, Commit> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    int64_t step;
    Commit c;
    if (fields >> step >> c.hash >> c.ms >> c.first >> c.count && c.hash.size() == 16) out[step] = c;
  }
  return out;
}

TEST(FaultToleranceProcesses, AReplicaKilledWholeIsRestartedHealsAndTheOthersNeverStop) {
  TempDir dir;
  ProcessRanks procs;
  const int lighthouse_port = free_port();
  auto& lighthouse = procs.spawn({DTRAIN_LIGHTHOUSE_EXECUTABLE, "--port", std::to_string(lighthouse_port),
                                  "--heartbeat-timeout", "1"},
                                 {});
  ASSERT_TRUE(procs.wait_for_output(lighthouse, "serving on", 30s)) << describe(lighthouse);
  constexpr int kSteps = 200, kDieAt = 40;
  std::vector<RankProcess*> runs;
  for (int k = 0; k < 3; ++k) {
    std::vector<std::string> argv{DTRAIN_RUN_EXECUTABLE, "--nproc-per-node", "2", "--max-restarts", "2",
                                  "--master-port", std::to_string(free_port()), DTRAIN_FT_EXAMPLE,
                                  "--replica-index", std::to_string(k),
                                  "--lighthouse", "127.0.0.1:" + std::to_string(lighthouse_port),
                                  "--steps", std::to_string(kSteps), "--step-ms", "20", "--log-every", "50",
                                  "--commit-log", dir.path() + "/replica-" + std::to_string(k) + ".log"};
    if (k == 2) argv.insert(argv.end(), {"--die-at-step", std::to_string(kDieAt)});
    runs.push_back(&procs.spawn(argv, {{"DTRAIN_TIMEOUT", "60"}}));
  }
  for (auto* run : runs) {
    ASSERT_TRUE(procs.wait(*run, std::chrono::steady_clock::now() + 240s)) << describe(*run);
    EXPECT_EQ(run->exit_code, 0) << describe(*run);
  }
  std::vector<std::map<int64_t, Commit>> logs;
  for (int k = 0; k < 3; ++k) logs.push_back(commits_of(dir.path() + "/replica-" + std::to_string(k) + ".log"));
  for (int k = 0; k < 2; ++k) {  // (a replica that started late healed into the job first)
    ASSERT_FALSE(logs[k].empty()) << k;
    const int64_t first = logs[k].begin()->first;
    EXPECT_LT(first, kDieAt) << "replica " << k << " joined before the kill";
    EXPECT_EQ(logs[k].size(), static_cast<size_t>(kSteps - first + 1))
        << "replica " << k << " committed every step from its first to the end: it never stopped";
  }
  // After every committed step, every replica that committed it holds the
  // same state, and took the same block of samples.
  std::map<int64_t, Commit> all;
  for (const auto& log : logs)
    for (const auto& [step, commit] : log) {
      auto [it, first] = all.emplace(step, commit);
      if (first) continue;
      EXPECT_EQ(commit.hash, it->second.hash) << "step " << step;
      EXPECT_EQ(commit.first, it->second.first) << "step " << step;
      EXPECT_EQ(commit.count, it->second.count) << "step " << step;
    }
  // Each sample exactly once: the committed steps' blocks follow each
  // other with no gap and no overlap from sample 0 on.
  int64_t next_sample = 0;
  for (const auto& [step, commit] : all) {
    EXPECT_EQ(commit.first, next_sample) << "step " << step;
    next_sample = commit.first + commit.count;
  }
  EXPECT_EQ(all.size(), static_cast<size_t>(kSteps));
  // What a death cost the survivors: the longest wait between two of their
  // commits (the steps themselves take --step-ms 20).
  int64_t longest = 0;
  for (int k = 0; k < 2; ++k)
    for (auto it = std::next(logs[k].begin()); it != logs[k].end(); ++it)
      longest = std::max(longest, it->second.ms - std::prev(it)->second.ms);
  std::printf("survivors' longest wait between commits: %lld ms\n", static_cast<long long>(longest));
  // The killed replica: its first life up to the step it died in; its
  // second, restarted by dtrain-run at step 0, healed from a live replica
  // (at once, or after a gap when the survivors went on without it) and
  // committed with the others to the end.
  const auto& c = logs[2];
  ASSERT_FALSE(c.empty());
  EXPECT_TRUE(c.count(kDieAt)) << "the first life committed up to step " << kDieAt;
  EXPECT_EQ(c.rbegin()->first, kSteps) << "the second life committed to the end";
  const std::string out = runs[2]->output();
  const auto died = out.find("dying at step " + std::to_string(kDieAt));
  ASSERT_NE(died, std::string::npos) << out;
  EXPECT_NE(out.find("restarting the workers", died), std::string::npos) << "its dtrain-run restarted it:\n" << out;
  EXPECT_NE(out.find(", healed,", died), std::string::npos) << "the second life healed:\n" << out;
  for (int k = 0; k < 2; ++k) EXPECT_EQ(runs[k]->output().find("restarting"), std::string::npos) << k;
}

}  // namespace
}  // namespace dtrain::testing
