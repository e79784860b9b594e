// The flight recorder through real failures: three ranks over env://, one
// of them faulty (stopped, exited, skipping an all_reduce, or calling it
// with another shape), DTRAIN_TRACE_DIR set. Every survivor writes its dump
// within the timeout + 1 s of the faulty collective, and `dtrain-trace
// analyze` names the faulty rank and the collective.

#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>

#include "harness/assertions.h"
#include "harness/process_ranks.h"

namespace dtrain::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const char* const kWorker = DTRAIN_TEST_WORKER;
const char* const kTrace = DTRAIN_TRACE_EXECUTABLE;
constexpr int kWorld = 3;
constexpr int64_t kTimeoutMs = 2000;

struct FaultCase {
  std::string backend, fault;
  int culprit;
  bool culprit_survives;  // skip and shape: the faulty rank fails too, and dumps
  std::string verdict;
};

void PrintTo(const FaultCase& c, std::ostream* os) { *os << c.backend << " " << c.fault; }

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/dtrain-trace-XXXXXX";
    path_ = mkdtemp(tmpl) ? tmpl : "";
  }
  ~TempDir() { std::system(("rm -rf " + path_).c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

int64_t mtime_ms(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return -1;
  return int64_t(st.st_mtim.tv_sec) * 1000 + st.st_mtim.tv_nsec / 1000000;
}

int64_t fault_at(const RankProcess& p, int rank) {
  const std::string tag = "rank " + std::to_string(rank) + " fault at ";
  const auto out = p.output();
  const auto at = out.find(tag);
  return at == std::string::npos ? -1 : std::stoll(out.substr(at + tag.size()));
}

// `dtrain-trace analyze dir`'s output, which must exit 1 (a rank at fault).
std::string analyzed(ProcessRanks& procs, const std::string& dir) {
  auto& analyzer = procs.spawn({kTrace, "analyze", dir}, {});
  EXPECT_TRUE(procs.wait(analyzer, Clock::now() + 30s)) << "dtrain-trace hung";
  EXPECT_EQ(analyzer.exit_code, 1) << analyzer.output();
  return analyzer.output();
}

// dtrain-run over 3 ranks of rank_worker's trace `fault` on tcp, with
// DTRAIN_TRACE_DIR=dir and `env`.
RankProcess& launch_faulty_job(ProcessRanks& procs, const std::string& fault,
                               const std::string& dir, std::map<std::string, std::string> env = {}) {
  env["DTRAIN_TRACE_DIR"] = dir;
  return procs.spawn({DTRAIN_RUN_EXECUTABLE, "--nproc-per-node", "3", "--master-port",
                      std::to_string(free_port()), kWorker, "trace", "tcp", fault},
                     env);
}

class FlightRecorderFaults : public ::testing::TestWithParam<FaultCase> {};

TEST_P(FlightRecorderFaults, EverySurvivorDumpsAndTheAnalyzerNamesTheRankAndOp) {
  const auto c = GetParam();
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const int port = free_port();
  ProcessRanks procs;
  for (int r = 0; r < kWorld; ++r) {
    auto env = rank_env(r, kWorld, port, std::to_string(kTimeoutMs / 1000));
    env["DTRAIN_TRACE_DIR"] = dir.path();
    procs.spawn({kWorker, "trace", c.backend, c.fault}, env);
  }
  for (int r = 0; r < kWorld; ++r) {
    if (r == c.culprit && !c.culprit_survives) continue;
    auto& p = procs.ranks()[r];
    ASSERT_TRUE(procs.wait(p, Clock::now() + 30s)) << "rank " << r << " hung: " << p.output();
    EXPECT_EQ(p.exit_code, 3) << "rank " << r << " should fail: " << p.output();
    const auto dump = dir.path() + "/rank-" + std::to_string(r) + ".json";
    const int64_t written = mtime_ms(dump), fault = fault_at(p, r);
    ASSERT_GE(written, 0) << "rank " << r << " wrote no dump: " << p.output();
    ASSERT_GE(fault, 0) << p.output();
    EXPECT_LE(written, fault + kTimeoutMs + 1000)
        << "rank " << r << " dumped " << written - fault << " ms after the faulty collective";
  }
  EXPECT_TRUE(Contains(analyzed(procs, dir.path()), c.verdict));
}

const std::string kNeverArrived =
    "verdict: rank 1 never arrived (no dump: exited, killed or stopped): rank 1 of group "
    "'default' left no dump while ranks 0, 2 reached #3 all_reduce (Float [4], SUM) (failed";

const std::string kSkipped =
    "verdict: rank 1 called a different collective: rank 1 called barrier at collective #4 of "
    "group 'default' where ranks 0, 2 called all_reduce (Float [4], SUM)";
const std::string kOtherShape =
    "verdict: rank 2 called a different collective: rank 2 called all_reduce (Float [5], SUM) at "
    "collective #3 of group 'default' where ranks 0, 1 called all_reduce (Float [4], SUM)";

std::vector<FaultCase> fault_cases() {
  std::vector<FaultCase> cases;
  for (const std::string backend : {"tcp", "shm"}) {
    cases.push_back({backend, "stop", 1, false, kNeverArrived});
    cases.push_back({backend, "exit", 1, false, kNeverArrived});
    cases.push_back({backend, "skip", 1, true, kSkipped});
    cases.push_back({backend, "shape", 2, true, kOtherShape});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Faults, FlightRecorderFaults, ::testing::ValuesIn(fault_cases()),
                         [](const auto& info) { return info.param.backend + "_" + info.param.fault; });

// dtrain-run, after rank 1 exits while the others compute: it asks the
// survivors for their flight recorders (SIGUSR2) before stopping them (with
// SIGTERM, on which they dump again), says where the dumps are, and the
// analyzer names rank 1.
TEST(FlightRecorderLauncher, CollectsTheSurvivorsDumpsAfterAFailure) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  ProcessRanks procs;
  auto& run = launch_faulty_job(procs, "exit-idle", dir.path());
  const auto t0 = Clock::now();
  ASSERT_TRUE(procs.wait(run, Clock::now() + 25s)) << "dtrain-run did not stop the survivors: "
                                                    << run.output();
  EXPECT_LT(Clock::now() - t0, 20s) << "the survivors were not stopped, they slept on";
  EXPECT_EQ(run.exit_code, 1) << run.output();
  EXPECT_TRUE(Contains(run.output(), "dtrain-run: flight recorder dumps of this node's ranks 0, 2 are in " +
                                         dir.path() + "; read them with: dtrain-trace analyze " + dir.path()));
  const auto verdict = analyzed(procs, dir.path());
  EXPECT_TRUE(Contains(verdict, "verdict: rank 1 never arrived (no dump: exited, killed or "
                                "stopped): rank 1 of group 'default' left no dump while "
                                "ranks 0, 2 reached #2 all_reduce (Float [4], SUM) (completed)"));
  // Asked on SIGUSR2, then stopped with SIGTERM: the later dump, on SIGTERM, is the one left.
  EXPECT_TRUE(Contains(verdict, "rank 0 (")) << verdict;
  EXPECT_TRUE(Contains(verdict, "dumped on SIGTERM")) << verdict;
}

// A rank that is slow, not dead: the others time out in #3 and fail;
// dtrain-run asks the slow rank for its recorder, and the analyzer says it
// is behind, at #2. A 5 s timeout: with 2 s, a rank slowed by a busy
// machine (ctest -j2 beside a compiler) before its first collective was
// itself taken for the one behind.
TEST(FlightRecorderLauncher, ASlowRankIsNamedBehind) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  ProcessRanks procs;
  auto& run = launch_faulty_job(procs, "slow", dir.path(), {{"DTRAIN_TIMEOUT", "5"}});
  ASSERT_TRUE(procs.wait(run, Clock::now() + 25s)) << run.output();
  EXPECT_TRUE(Contains(run.output(), "dtrain-run: flight recorder dumps of this node's ranks 0, 1, 2"));
  EXPECT_TRUE(Contains(analyzed(procs, dir.path()),
                       "verdict: rank 1 is behind in group 'default': its last collective is #2 "
                       "all_reduce (Float [4], SUM) (completed), while ranks 0, 2 reached #3 "
                       "all_reduce (Float [4], SUM) (failed"));
}

// The dumps in `dir`, by file name; fails the test on one that is not JSON.
std::map<std::string, nlohmann::json> dumps_in(const std::string& dir) {
  std::map<std::string, nlohmann::json> out;
  std::unique_ptr<DIR, int (*)(DIR*)> d(opendir(dir.c_str()), closedir);
  if (!d) return out;
  while (dirent* e = readdir(d.get())) {
    const std::string name = e->d_name;
    if (name.rfind("rank-", 0) != 0) continue;
    std::ifstream in(dir + "/" + name);
    try {
      out[name] = nlohmann::json::parse(in);
    } catch (const std::exception& err) {
      ADD_FAILURE() << name << " is not a complete dump: " << err.what();
      out[name] = nullptr;
    }
  }
  return out;
}

// Issue 30 item 11, as a user meets it: rank 2 skips the last all_reduce
// (a data-dependent branch) and computes on; ranks 0 and 1 time out, and
// their TimeoutError escapes main (std::terminate, SIGABRT). Their dumps
// are complete and in place (not rank-R.json.tmp) although the process
// aborts, and the analyzer names rank 2, not the ranks that waited.
TEST(FlightRecorderLauncher, RanksWhoseTimeoutEscapesMainLeaveCompleteDumps) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  ProcessRanks procs;
  auto& run = procs.spawn({DTRAIN_RUN_EXECUTABLE, "--nproc-per-node", "3", "--master-port",
                           std::to_string(free_port()), kWorker, "trace-uncaught"},
                          {{"DTRAIN_TRACE_DIR", dir.path()}, {"DTRAIN_TIMEOUT", "3"}});
  ASSERT_TRUE(procs.wait(run, Clock::now() + 60s)) << run.output();
  const auto out = run.output();
  EXPECT_EQ(run.exit_code, 1) << out;
  EXPECT_TRUE(Contains(out, ") killed by SIGABRT at ")) << "the error did not escape main";
  EXPECT_TRUE(Contains(out, "TimeoutError: all_reduce #4 on group 'default'"));
  EXPECT_TRUE(Contains(out, "has not reached this collective"));
  const auto dumps = dumps_in(dir.path());
  for (const auto& [name, dump] : dumps)
    EXPECT_EQ(name.find(".tmp"), std::string::npos) << name << " was left unfinished";
  for (int r = 0; r < 2; ++r) {
    const auto it = dumps.find("rank-" + std::to_string(r) + ".json");
    ASSERT_NE(it, dumps.end()) << "rank " << r << " left no complete dump: " << out;
    if (it->second.is_null()) continue;
    EXPECT_TRUE(Contains(it->second.at("reason").get<std::string>(),
                         "failure: all_reduce #4 on group 'default'"));
  }
  EXPECT_EQ(dumps.count("rank-2.json"), 1u) << "dtrain-run did not get rank 2's dump";
  const auto verdict = analyzed(procs, dir.path());
  EXPECT_TRUE(Contains(verdict, "verdict: rank 2 is behind in group 'default': its last collective "
                                "is #3 all_reduce (Float [4], SUM) (completed), while ranks 0, 1 "
                                "reached #4 all_reduce (Float [4], SUM) (failed: "));
  EXPECT_FALSE(Contains(verdict, "never arrived")) << verdict;
}

// dtrain-run told to stop (SIGTERM, as Slurm's scancel does) while every
// rank computes: it stops the workers with SIGTERM, and each of them
// leaves a complete dump first, then ends as SIGTERM ends it.
TEST(FlightRecorderLauncher, WorkersStoppedWithSigtermLeaveCompleteDumps) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  ProcessRanks procs;
  auto& run = launch_faulty_job(procs, "idle", dir.path());
  for (int r = 0; r < kWorld; ++r)
    ASSERT_TRUE(procs.wait_for_output(run, "rank " + std::to_string(r) + " fault at ", 30s))
        << run.output();
  const auto t0 = Clock::now();
  ASSERT_EQ(kill(run.pid, SIGTERM), 0);
  ASSERT_TRUE(procs.wait(run, Clock::now() + 30s)) << run.output();
  EXPECT_LT(Clock::now() - t0, 10s) << "the workers did not end promptly on SIGTERM";
  EXPECT_EQ(run.exit_code, 128 + SIGTERM) << run.output();
  EXPECT_TRUE(Contains(run.output(), "dtrain-run: received SIGTERM while the workers ran; "
                                     "stopping the workers"));
  const auto dumps = dumps_in(dir.path());
  for (int r = 0; r < kWorld; ++r) {
    const auto it = dumps.find("rank-" + std::to_string(r) + ".json");
    ASSERT_NE(it, dumps.end()) << "rank " << r << " left no dump on SIGTERM: " << run.output();
    if (!it->second.is_null()) EXPECT_EQ(it->second.at("reason"), "SIGTERM");
  }
  EXPECT_EQ(dumps.size(), size_t(kWorld)) << "a dump was left unfinished";
  auto& analyzer = procs.spawn({kTrace, "analyze", dir.path()}, {});
  ASSERT_TRUE(procs.wait(analyzer, Clock::now() + 30s));
  EXPECT_EQ(analyzer.exit_code, 0) << analyzer.output();
  EXPECT_TRUE(Contains(analyzer.output(), "verdict: the ranks agree and none is behind"));
}

// A dump as the recorder writes it: rank `rank` of 3 in group 'default',
// its all_reduces #0..#last, the last one `last_state`; then a second group.
std::string dump_text(int rank, int last, const std::string& last_state) {
  std::ostringstream out;
  out << "{\"format\": \"dtrain-flight-recorder\", \"version\": 1, \"rank\": " << rank
      << ", \"world_size\": 3, \"pid\": " << 100 + rank << ", \"host\": \"node-a\", "
      << "\"reason\": \"failure: all_reduce #4 timed out\", \"groups\": [\n{\"name\": \"default\", "
      << "\"rank\": " << rank << ", \"size\": 3, \"backend\": \"shm\", \"global_ranks\": [0, 1, 2], "
      << "\"entries\": [";
  for (int seq = 0; seq <= last; ++seq)
    out << (seq ? ",\n" : "\n") << "  {\"seq\": " << seq
        << ", \"op\": \"all_reduce\", \"kind\": \"collective\", \"dtype\": \"Float\", \"shape\": [4], "
        << "\"numel\": 4, \"root\": -1, \"reduce_op\": \"SUM\", \"state\": \""
        << (seq == last ? last_state : "completed") << "\", \"issued_us\": 1, \"finished_us\": 2, "
        << "\"error\": \"" << (last_state == "failed" && seq == last ? "timed out [\\\"x\\\"]" : "")
        << "\"}";
  out << "]},\n{\"name\": \"pp\", \"rank\": 0, \"size\": 1, \"backend\": \"shm\", "
      << "\"global_ranks\": [" << rank << "], \"entries\": []}]}\n";
  return out.str();
}

const std::string kErrorOfRank1 =
    "dtrain::TimeoutError: all_reduce #4 on group 'default' (rank 1/3, backend shm) timed out "
    "waiting for rank 2 (it is alive but has not reached this collective: stopped, stuck, or "
    "running different collectives)";

// The analyzer with partial evidence (what a job whose ranks were killed
// mid-dump leaves): rank 0's dump cut short (rank-0.json.tmp, cut inside
// its second group), rank 1 with no dump but dtrain-run's copy of its error
// file, rank 2's complete dump. It names rank 2, not "never arrived".
TEST(FlightRecorderLauncher, AnalyzerUsesUnfinishedDumpsAndErrorFiles) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const auto full0 = dump_text(0, 4, "failed");
  const auto cut = full0.find("\"global_ranks\": [0]") + 20;  // inside group 'pp'
  ASSERT_LT(cut, full0.size());
  std::ofstream(dir.path() + "/rank-0.json.tmp") << full0.substr(0, cut);
  std::ofstream(dir.path() + "/rank-2.json") << dump_text(2, 3, "completed");
  std::ofstream(dir.path() + "/error-1.json")
      << nlohmann::json{{"rank", 1}, {"message", kErrorOfRank1 + "\nsecond line"}}.dump();
  ProcessRanks procs;
  const auto out = analyzed(procs, dir.path());
  EXPECT_TRUE(Contains(out, "verdict: rank 2 is behind in group 'default': its last collective is "
                            "#3 all_reduce (Float [4], SUM) (completed), while ranks 0, 1 reached "
                            "#4 all_reduce (Float [4], SUM) (failed: timed out [\"x\"])"));
  EXPECT_TRUE(Contains(out, "rank 0 (node-a, pid 100) dumped on failure: all_reduce #4 timed out "
                            "(incomplete: " + dir.path() + "/rank-0.json.tmp was cut short; what "
                            "it holds whole is used)"));
  EXPECT_TRUE(Contains(out, "rank 1 left no dump; its error file (" + dir.path() +
                                "/error-1.json) says: " + kErrorOfRank1 + "\n"));
  EXPECT_TRUE(Contains(out, "rank 1 failed in group 'default' at #4 all_reduce (failed: " +
                                kErrorOfRank1 + ") (from its error file)"));
  EXPECT_FALSE(Contains(out, "never arrived")) << out;

  // Only error files for the ranks that waited (their dumps cut before any
  // entry: nothing usable): still rank 2, the leaders' collective as their
  // errors name it.
  std::ofstream(dir.path() + "/rank-0.json.tmp") << full0.substr(0, 40);
  std::ofstream(dir.path() + "/error-0.json")
      << nlohmann::json{{"rank", 0}, {"message", kErrorOfRank1}}.dump();
  const auto out2 = analyzed(procs, dir.path());
  EXPECT_TRUE(Contains(out2, "verdict: rank 2 is behind in group 'default': its last collective "
                             "is #3 all_reduce (Float [4], SUM) (completed), while ranks 0, 1 "
                             "reached #4 all_reduce (failed: " + kErrorOfRank1 + ")"));
  EXPECT_TRUE(Contains(out2, dir.path() + "/rank-0.json.tmp: an unfinished dump with nothing usable"));

  // An error note that is not one is refused, naming the file.
  std::ofstream(dir.path() + "/error-0.json") << "{\"rank\": \"zero\"}";
  auto& bad = procs.spawn({kTrace, "analyze", dir.path()}, {});
  ASSERT_TRUE(procs.wait(bad, Clock::now() + 30s));
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_TRUE(Contains(bad.output(), "dtrain-trace: " + dir.path() + "/error-0.json: 'rank' is not an integer"));
}

// Point-to-point operations that never completed are named with their
// labels (a pipeline's stage and microbatch), and make the verdict when the
// collectives agree.
TEST(FlightRecorderLauncher, AnalyzerNamesUnfinishedPointToPointWithItsLabel) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  for (int rank = 0; rank < 2; ++rank) {
    std::ofstream out(dir.path() + "/rank-" + std::to_string(rank) + ".json");
    out << "{\"format\": \"dtrain-flight-recorder\", \"version\": 1, \"rank\": " << rank
        << ", \"world_size\": 2, \"pid\": " << 100 + rank << ", \"host\": \"node-a\", "
        << "\"reason\": \"SIGUSR2\", \"groups\": [{\"name\": \"pp\", \"rank\": " << rank
        << ", \"size\": 2, \"backend\": \"tcp\", \"global_ranks\": [0, 1], \"entries\": ["
        << "{\"seq\": 0, \"op\": \"send\", \"kind\": \"p2p\", \"dtype\": \"Float\", "
        << "\"shape\": [4], \"numel\": 4, \"root\": " << 1 - rank << ", \"reduce_op\": \"\", "
        << "\"state\": \"completed\", \"issued_us\": 1, \"finished_us\": 2, \"error\": \"\"}, "
        << "{\"seq\": 1, \"op\": \"recv\", \"kind\": \"p2p\", \"dtype\": \"Float\", "
        << "\"shape\": [4], \"numel\": 4, \"root\": " << 1 - rank << ", \"reduce_op\": \"\", "
        << "\"state\": \"" << (rank == 0 ? "started" : "completed") << "\", \"issued_us\": 1, "
        << "\"finished_us\": 0, \"error\": \"\", \"label\": \"pipeline stage " << rank
        << ", microbatch 3, gradient of the output\"}]}]}\n";
  }
  ProcessRanks procs;
  const auto out = analyzed(procs, dir.path());
  EXPECT_TRUE(Contains(out, "verdict: the collectives agree; rank 0 in group 'pp': recv #1 from "
                            "group rank 1 [pipeline stage 0, microbatch 3, gradient of the "
                            "output] did not complete (started)"))
      << out;
  EXPECT_FALSE(Contains(out, "rank 1 in group 'pp'")) << out;
}

TEST(FlightRecorderLauncher, AnalyzerRefusesWhatIsNotADump) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  std::ofstream(dir.path() + "/rank-0.json") << "{\"format\": \"dtrain-flight-recorder\", \"version\": 1, \"rank\": 0";
  ProcessRanks procs;
  auto& analyzer = procs.spawn({kTrace, "analyze", dir.path()}, {});
  ASSERT_TRUE(procs.wait(analyzer, Clock::now() + 30s));
  EXPECT_EQ(analyzer.exit_code, 2);
  EXPECT_TRUE(Contains(analyzer.output(), "dtrain-trace: " + dir.path() + "/rank-0.json: not a valid dump: "));
  auto& empty = procs.spawn({kTrace, "analyze", "/nonexistent-dir"}, {});
  ASSERT_TRUE(procs.wait(empty, Clock::now() + 30s));
  EXPECT_EQ(empty.exit_code, 2);
  EXPECT_TRUE(Contains(empty.output(), "dtrain-trace: /nonexistent-dir: cannot open the directory"));
}

// DTRAIN_TIMELINE through dtrain-run: one valid trace file with a track
// group per rank, each DDP step's forward, backward, optimizer span and
// buckets; spans on a track nest; the buckets' time is DDPStats'.
TEST(Timeline, DtrainRunMergesTheRanksIntoOneValidTrace) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string path = dir.path() + "/timeline.json";
  ProcessRanks procs;
  auto& run = procs.spawn({DTRAIN_RUN_EXECUTABLE, "--nproc-per-node", "2", "--master-port",
                           std::to_string(free_port()), kWorker, "timeline"},
                          {{"DTRAIN_TIMELINE", path}});
  ASSERT_TRUE(procs.wait(run, Clock::now() + 60s)) << run.output();
  ASSERT_EQ(run.exit_code, 0) << run.output();
  EXPECT_TRUE(Contains(run.output(), "dtrain-run: timeline of 2 ranks written to " + path));
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(access((path + ".rank-" + std::to_string(r) + ".json").c_str(), F_OK), 0)
        << "the parts are removed once merged";
  std::ifstream in(path);
  nlohmann::json trace;
  ASSERT_NO_THROW(trace = nlohmann::json::parse(in)) << "not valid JSON";
  const auto& events = trace.at("traceEvents");
  for (int r = 0; r < 2; ++r) {
    std::map<std::string, int> count;
    std::map<int, std::vector<std::pair<int64_t, int64_t>>> tracks;  // tid -> [ts, end)
    double bucket_us = 0;
    std::set<std::string> bucket_names;
    for (const auto& e : events) {
      if (e.at("pid").get<int>() != r || e.at("ph") != "X") continue;
      const auto name = e.at("name").get<std::string>();
      const auto ts = e.at("ts").get<int64_t>(), dur = e.at("dur").get<int64_t>();
      const bool bucket = name.rfind("bucket ", 0) == 0 && name.find(" ready") == std::string::npos;
      ++count[bucket ? "bucket" : name];
      if (bucket) bucket_us += dur, bucket_names.insert(name);
      tracks[e.at("tid").get<int>()].push_back({ts, ts + dur});
    }
    EXPECT_EQ(count["forward"], 6) << "rank " << r;
    EXPECT_EQ(count["backward"], 6) << "rank " << r;
    EXPECT_EQ(count["optimizer.step"], 6) << "rank " << r;
    EXPECT_GE(count["bucket"], 6) << "rank " << r << ": a bucket each step at least";
    EXPECT_GE(bucket_names.size(), 2u) << "rank " << r << ": buckets have tracks of their own";
    EXPECT_GE(count["all_reduce"], count["bucket"]) << "rank " << r;
    for (auto& [tid, spans] : tracks) {
      std::sort(spans.begin(), spans.end(),
                [](auto a, auto b) { return a.first < b.first || (a.first == b.first && a.second > b.second); });
      std::vector<int64_t> open;  // ends of the enclosing spans
      for (const auto& [b, e] : spans) {
        while (!open.empty() && open.back() <= b) open.pop_back();
        EXPECT_TRUE(open.empty() || e <= open.back())
            << "rank " << r << " track " << tid << ": [" << b << ", " << e
            << ") overlaps a span that ends at " << open.back() << " without nesting in it";
        open.push_back(e);
      }
    }
    const std::string tag = "rank " + std::to_string(r) + " comm_ms ";
    const auto at = run.output().find(tag);
    ASSERT_NE(at, std::string::npos) << run.output();
    const double stats_us = std::stod(run.output().substr(at + tag.size())) * 1000;
    EXPECT_NEAR(bucket_us, stats_us, 0.1 * stats_us + 50)
        << "rank " << r << ": the buckets' spans sum to " << bucket_us << " us, DDPStats to "
        << stats_us;
  }
}

}  // namespace
}  // namespace dtrain::testing
