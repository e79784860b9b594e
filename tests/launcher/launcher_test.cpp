// dtrain-run on one node: the worker contract, failure summaries, restarts,
// logs, and bad input (signals: launcher_signals_test.cpp).

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "harness/assertions.h"
#include "harness/process_ranks.h"
#include "launcher/launch.h"

namespace dtrain::testing {
namespace {

TEST(Launcher, GivesEveryWorkerTorchrunsEnvironment) {
  auto r = launch({"--nproc-per-node", "3", "--standalone", kProbe, "env"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::string run_id, port;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string p = "[" + std::to_string(rank) + "]:env ";
    // A named vector: gcc 16 warns (-Wfree-nonheap-object, a false positive)
    // on a range-for over this list as a temporary.
    const std::vector<std::pair<std::string, std::string>> expected{
        {"RANK", std::to_string(rank)}, {"LOCAL_RANK", std::to_string(rank)},
        {"GROUP_RANK", "0"}, {"ROLE_RANK", std::to_string(rank)}, {"ROLE_NAME", "default"},
        {"LOCAL_WORLD_SIZE", "3"}, {"WORLD_SIZE", "3"}, {"GROUP_WORLD_SIZE", "1"},
        {"ROLE_WORLD_SIZE", "3"}, {"MASTER_ADDR", "127.0.0.1"},
        {"TORCHELASTIC_RESTART_COUNT", "0"}, {"TORCHELASTIC_MAX_RESTARTS", "0"},
        {"OMP_NUM_THREADS", "1"}};
    for (const auto& [k, v] : expected) EXPECT_TRUE(Contains(r.output, p + k + "=" + v + "\n"));
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.output, m, std::regex("\\[" + std::to_string(rank) +
                                                          "\\]:env MASTER_PORT=([0-9]+)")));
    if (rank == 0) port = m[1];
    EXPECT_EQ(m[1], port) << "every rank must get the same MASTER_PORT";
    ASSERT_TRUE(std::regex_search(r.output, m, std::regex("\\[" + std::to_string(rank) +
                                                          "\\]:env TORCHELASTIC_RUN_ID=(\\w+)")));
    if (rank == 0) run_id = m[1];
    EXPECT_EQ(m[1], run_id);
  }
}

// Workers are the kernel's first choice under memory pressure, before
// dtrain-run (which holds the host's snapshot keeper): their oom_score_adj
// is the launcher's plus 500. Before, they had the launcher's.
TEST(Launcher, WorkersAreTheOomKillersFirstChoiceBeforeTheLauncher) {
  std::ifstream in("/proc/self/oom_score_adj");
  int mine = 0;
  ASSERT_TRUE(in >> mine);
  auto r = launch({"--nproc-per-node", "1", "--standalone", "/bin/cat", "/proc/self/oom_score_adj"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, "[0]:" + std::to_string(std::min(1000, mine + 500)) + "\n")) << r.output;
}

TEST(Launcher, ReadsFlagsFromPetVariablesAndUnderscoreSpellings) {
  ProcessRanks procs;
  auto& p = procs.spawn({kRun, "--standalone", "--max_restarts", "0", kProbe, "env"},
                        {{"PET_NPROC_PER_NODE", "3"}});
  ASSERT_TRUE(procs.wait(p, Clock::now() + 60s));
  EXPECT_EQ(p.exit_code, 0) << p.output();
  EXPECT_TRUE(Contains(p.output(), "[2]:env WORLD_SIZE=3\n"));
}

TEST(Launcher, ReplacesLocalRankInArguments) {
  auto r = launch({"--nproc-per-node", "2", "--master-port", std::to_string(free_port()), kProbe,
                   "arg", "shard-${local_rank}.bin"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, "[0]:arg shard-0.bin"));
  EXPECT_TRUE(Contains(r.output, "[1]:arg shard-1.bin"));
}

TEST(Launcher, SummaryNamesRankExitCodeAndLastLines) {
  auto r = launch({"--nproc-per-node", "2", "--master-port", std::to_string(free_port()), kProbe,
                   "exit", "7"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(Contains(r.output, "dtrain-run: job failed (attempt 0, 0/0 restarts used)"));
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex("rank 1 \\(local rank 1 on node 0, pid [0-9]+\\) exited with code 7 "
                           "at [0-9]{4}-[0-9]{2}-[0-9]{2} [0-9:]{8}")))
      << r.output;
  EXPECT_TRUE(Contains(r.output, "    about to fail on purpose"));
  EXPECT_TRUE(Contains(r.output, "    stderr line before failing"));
}

TEST(Launcher, SummaryNamesTheSignal) {
  auto r = launch({"--nproc-per-node", "2", "--standalone", kProbe, "signal"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(Contains(r.output, "killed by SIGSEGV")) << r.output;
  EXPECT_TRUE(Contains(r.output, "about to crash"));
}

// Error files (TORCHELASTIC_ERROR_FILE): the summary shows why the worker
// failed — an exception nobody caught (recorded by the terminate handler
// init_process_group installs), one recorded with dtrain::record_error, or
// what a program without dtrain wrote in torchrun's format.
TEST(Launcher, SummaryShowsTheRootCauseFromTheErrorFile) {
  auto uncaught = launch({"--nproc-per-node", "2", "--standalone", kProbe, "throw"});
  EXPECT_EQ(uncaught.exit_code, 1) << uncaught.output;
  EXPECT_TRUE(Contains(uncaught.output, "killed by SIGABRT")) << uncaught.output;
  EXPECT_TRUE(std::regex_search(uncaught.output,
                                std::regex("  root cause \\(its error file /[^ ]*/attempt_0/1/error.json\\):\n"
                                           "    std::out_of_range: batch 7 has no label 11 "
                                           "\\(deliberately thrown on rank 1\\)\n")))
      << uncaught.output;
  // Without --log-dir they live in a temporary directory, gone with the launcher.
  std::smatch where;
  ASSERT_TRUE(std::regex_search(uncaught.output, where, std::regex("its error file (/[^ ]*)/attempt_0/1/error.json")));
  EXPECT_NE(::access(where[1].str().c_str(), F_OK), 0) << where[1] << " was left behind";

  auto recorded = launch({"--nproc-per-node", "2", "--standalone", kProbe, "record"});
  EXPECT_EQ(recorded.exit_code, 1) << recorded.output;
  EXPECT_TRUE(Contains(recorded.output, "[1]:recorded 1")) << recorded.output;
  EXPECT_TRUE(Contains(recorded.output, "exited with code 2")) << recorded.output;
  EXPECT_TRUE(Contains(recorded.output, "    std::invalid_argument: --lr must be positive, got -1\n"))
      << recorded.output;

  const std::string torchrun_format =
      R"({"message": {"message": "ValueError: no such split 'tset'\nTraceback (most recent call last): ...",)"
      R"( "extraInfo": {"py_callstack": "...", "timestamp": "1764000000"}}})";
  auto foreign = launch({"--nproc-per-node", "2", "--standalone", kProbe, "error-file", torchrun_format});
  EXPECT_EQ(foreign.exit_code, 1) << foreign.output;
  EXPECT_TRUE(Contains(foreign.output, "    ValueError: no such split 'tset'\n    Traceback (most recent call last): ...\n"))
      << foreign.output;
}

// An error file is the worker's own writing: a damaged one is named, not trusted.
TEST(Launcher, DamagedErrorFilesAreNamedNotTrusted) {
  auto not_json = launch({"--nproc-per-node", "2", "--standalone", kProbe, "error-file", "{\"message\": "});
  EXPECT_EQ(not_json.exit_code, 1) << not_json.output;
  EXPECT_TRUE(std::regex_search(not_json.output,
                                std::regex("its error file /[^ ]*/error.json could not be used: it is not JSON")))
      << not_json.output;
  EXPECT_TRUE(Contains(not_json.output, "exited with code 3"));
  auto no_message = launch({"--nproc-per-node", "2", "--standalone", kProbe, "error-file", "[1, 2]"});
  EXPECT_TRUE(Contains(no_message.output, "could not be used: it has no \"message\"")) << no_message.output;
}

// With --log-dir the error files live beside the logs, as torchrun puts them.
TEST(Launcher, ErrorFilesGoBesideTheLogs) {
  char tmpl[] = "/tmp/dtrain-errfile-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  auto r = launch({"--nproc-per-node", "2", "--master-port", std::to_string(free_port()), "--log-dir", dir,
                   "--rdzv-id", "job7", kProbe, "record"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  std::ifstream in(dir + "/job7/attempt_0/1/error.json");
  ASSERT_TRUE(in) << r.output;
  std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_TRUE(Contains(text, R"("message": {"message": "std::invalid_argument: --lr must be positive, got -1")"))
      << text;
  EXPECT_TRUE(Contains(r.output, "root cause (its error file " + dir + "/job7/attempt_0/1/error.json)"));
  ASSERT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

// c10d: a node that arrives when the running round is already at MAX
// nodes is refused, naming the limit (with room, it would wait and the job
// would grow: netns_launcher_test.sh).
TEST(Launcher, ANodeBeyondTheMaximumIsRefusedNamingIt) {
  const std::vector<std::string> job = {kRun, "--nproc-per-node", "1", "--nnodes", "1:1", "--rdzv-backend",
                                        "c10d", "--rdzv-endpoint", "127.0.0.1:" + std::to_string(free_port()),
                                        "--rdzv-id", "full", kProbe, "grow", "30"};
  ProcessRanks procs;
  auto& first = procs.spawn(job, {{"OMP_NUM_THREADS", "1"}});
  ASSERT_TRUE(procs.wait_for_output(first, "world 1 attempt 0", 30000ms)) << first.output();
  auto late = launch(std::vector<std::string>(job.begin() + 1, job.end()));
  EXPECT_EQ(late.exit_code, 1) << late.output;
  EXPECT_TRUE(Contains(late.output, "rendezvous 'full' at 127.0.0.1:")) << late.output;
  EXPECT_TRUE(Contains(late.output, ": round 0 closed with 1 node(s), the maximum (--nnodes 1:1), before this "
                                    "node joined"))
      << late.output;
  kill(first.pid, SIGTERM);
  procs.wait(first, Clock::now() + 30s);
}

// --replicas runs a fault-tolerant job's replica groups on this node, each
// with its own rendezvous: several nodes or a shared rendezvous are
// refused, naming what to do instead.
TEST(Launcher, ReplicasRefuseSeveralNodesAndASharedRendezvous) {
  auto nodes = launch({"--replicas", "2", "--nnodes", "2", kProbe});
  EXPECT_EQ(nodes.exit_code, 2) << nodes.output;
  EXPECT_TRUE(Contains(nodes.output, "--replicas runs every replica group on this node; drop --nnodes")) << nodes.output;
  auto shared = launch({"--replicas", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400", kProbe});
  EXPECT_EQ(shared.exit_code, 2) << shared.output;
  EXPECT_TRUE(Contains(shared.output, "--replicas gives each replica a rendezvous of its own")) << shared.output;
  auto many = launch({"--replicas", "5000", kProbe});
  EXPECT_EQ(many.exit_code, 2) << many.output;
  EXPECT_TRUE(Contains(many.output, "--replicas 5000: expected 1..1024")) << many.output;
}

TEST(Launcher, RestartsUntilTheProgramSucceeds) {
  auto r = launch({"--nproc-per-node", "2", "--standalone", "--max-restarts", "3", kProbe,
                   "fail-until", "2"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  // Each attempt is seen by at least one rank: when one rank fails, the
  // launcher stops the other, which may not have printed yet (seen under
  // ctest -j2).
  for (int a = 0; a <= 2; ++a)
    EXPECT_TRUE(Contains(r.output, "]:attempt " + std::to_string(a) + "\n"));
  EXPECT_TRUE(Contains(r.output, "restarting the workers (restart 2 of 3)"));
  EXPECT_FALSE(Contains(r.output, "attempt 3"));
}

TEST(Launcher, ExhaustedRestartsFailWithASummary) {
  auto r = launch({"--nproc-per-node", "2", "--standalone", "--max-restarts", "1", kProbe,
                   "fail-until", "5"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(Contains(r.output, "dtrain-run: job failed (attempt 1, 1/1 restarts used)"));
  EXPECT_TRUE(Contains(r.output, "exited with code 3"));
}

// Workers are in their own process groups: one reading a terminal would be
// stopped by SIGTTIN. They read /dev/null unless --keep-stdin.
TEST(Launcher, WorkersReadDevNullUnlessAsked) {
  // stdin: a pipe that stays open (with no data) for 20 s.
  const std::string port = " --master-port " + std::to_string(free_port());
  auto r = launch_shell(kRun + port + " --nproc-per-node 1 " + kProbe + " stdin < <(sleep 20)");
  EXPECT_TRUE(Contains(r.output, "[0]:stdin eof")) << r.output;
  r = launch_shell("echo hi | " + kRun + port + " --keep-stdin --nproc-per-node 1 " + kProbe +
                   " stdin");
  EXPECT_TRUE(Contains(r.output, "[0]:stdin data")) << r.output;
}

// A worker's child that leaves its process group and keeps the output pipe
// open must not keep the launcher from finishing.
TEST(Launcher, AnEscapedGrandchildHoldingTheOutputDoesNotHangTheLauncher) {
  auto r = launch({"--nproc-per-node", "1", "--master-port", std::to_string(free_port()), kProbe,
                   "daemon"},
                  50s);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_LT(r.took, 20s) << "dtrain-run waited for the escaped child's pipe";
  std::smatch m;
  if (std::regex_search(r.output, m, std::regex("daemon ([0-9]+)"))) kill(std::stoi(m[1]), SIGKILL);
}

TEST(Launcher, RedirectsAndTeeWriteLogFiles) {
  char dir[] = "/tmp/dtrain-run-logs-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  auto r = launch({"--nproc-per-node", "2", "--master-port", std::to_string(free_port()),
                   "--rdzv-id", "job1", "--log-dir", dir, "--redirects", "3", "--tee", "0:1",
                   kProbe, "arg", "hello"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, "[0]:arg hello"));   // local rank 0 tees stdout
  EXPECT_FALSE(Contains(r.output, "[1]:arg hello"));  // local rank 1 only to its file
  auto read = [](const std::string& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  const std::string base = std::string(dir) + "/job1/attempt_0/";
  EXPECT_EQ(read(base + "0/stdout.log"), "arg hello\n");
  EXPECT_EQ(read(base + "1/stdout.log"), "arg hello\n");
  EXPECT_EQ(read(base + "1/stderr.log"), "");
  std::system(("rm -rf " + std::string(dir)).c_str());
}

TEST(Launcher, LocalRanksFilterShowsOnlyChosenRanks) {
  auto r = launch({"--nproc-per-node", "3", "--standalone", "--local-ranks-filter", "1", kProbe,
                   "arg", "x"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, "[1]:arg x"));
  EXPECT_FALSE(Contains(r.output, "[0]:arg x"));
  EXPECT_FALSE(Contains(r.output, "[2]:arg x"));
}

TEST(Launcher, RunsADtrainJob) {
  auto r = launch({"--nproc-per-node", "3", "--standalone", kProbe, "allreduce"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 3; ++rank)
    EXPECT_TRUE(Contains(r.output, "[" + std::to_string(rank) + "]:rank " + std::to_string(rank) +
                                       " sum 3 world 3"));
}

// --standalone makes a fresh job token for each job (64 hex digits), which
// its store requires and its workers' clients prove (RunsADtrainJob); a
// token the user set is kept, and static mode makes none.
TEST(Launcher, StandaloneJobsGetAFreshTokenAndUsersKeepTheirs) {
  auto a = launch({"--nproc-per-node", "1", "--standalone", kProbe, "env"});
  EXPECT_TRUE(Contains(a.output, "[0]:env DTRAIN_STORE_TOKEN length 64")) << a.output;
  auto b = launch_shell("DTRAIN_STORE_TOKEN=mine " + kRun + " --nproc-per-node 1 --standalone " +
                        kProbe + " env");
  EXPECT_TRUE(Contains(b.output, "[0]:env DTRAIN_STORE_TOKEN length 4")) << b.output;
  auto c = launch({"--nproc-per-node", "1", "--master-port", std::to_string(free_port()), kProbe,
                   "env"});
  EXPECT_TRUE(Contains(c.output, "[0]:env DTRAIN_STORE_TOKEN length 0")) << c.output;
}

// torchrun's static contract: one port, the one the user named, where the
// launcher's own store serves the workers (TORCHELASTIC_USE_AGENT_STORE).
TEST(Launcher, WorkersUseTheLaunchersStoreOnTheNamedPort) {
  const std::string port = std::to_string(free_port());
  auto r = launch({"--nproc-per-node", "2", "--master-port", port, kProbe, "env"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* rank : {"0", "1"}) {
    EXPECT_TRUE(Contains(r.output, std::string("[") + rank + "]:env MASTER_PORT=" + port + "\n"))
        << r.output;
    EXPECT_TRUE(Contains(r.output, std::string("[") + rank +
                                       "]:env TORCHELASTIC_USE_AGENT_STORE=True\n"));
  }
  r = launch({"--nproc-per-node", "2", "--master-port", port, kProbe, "allreduce"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, "[1]:rank 1 sum 2 world 2")) << r.output;
}

// A PyTorch program (Debian's python3-torch) launched by dtrain-run finds
// the agent store and trains, as under torchrun. USE_LIBUV=0: Debian builds
// PyTorch 2.6 and 2.14 without libuv, and their TCPStore refuses to start
// unless told so (under any launcher; 1.13 ignores the variable); the
// worker imports no_libuv.py for what 2.14 does not take from the variable.
TEST(Launcher, RunsAPyTorchProgram) {
  const std::string port = std::to_string(free_port());
  auto r = launch({"--nproc-per-node", "2", "--master-port", port, "/usr/bin/env", "USE_LIBUV=0",
                   PYTHON_WITH_TORCH, PYTORCH_WORKER},
                  120s);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* rank : {"0", "1"})
    EXPECT_TRUE(Contains(r.output, std::string("]:rank ") + rank + " sum 3 world 2 port " + port +
                                       " agent True"))
        << r.output;
}

struct BadInput {
  const char* name;
  std::vector<std::string> args;
  const char* message;
};

void PrintTo(const BadInput& c, std::ostream* os) { *os << c.name; }

class LauncherBadInput : public ::testing::TestWithParam<BadInput> {};

TEST_P(LauncherBadInput, FailsNamingTheProblem) {
  auto args = GetParam().args;
  for (auto& a : args)
    if (a == "PROBE") a = kProbe;
  auto r = launch(args, 20s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, GetParam().message));
  EXPECT_LT(r.took, 10s);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LauncherBadInput,
    ::testing::Values(
        BadInput{"UnknownFlag", {"--bogus", "1", "PROBE"}, "--bogus"},
        BadInput{"ZeroProcs", {"--nproc-per-node", "0", "PROBE"},
                 "--nproc-per-node 0: expected a whole number in 1..4096"},
        BadInput{"NodesMinAboveMax", {"--nnodes", "3:2", "PROBE"},
                 "--nnodes 3:2: MIN must not exceed MAX"},
        BadInput{"NodeRankTooLarge", {"--nnodes", "2", "--node-rank", "2", "PROBE"},
                 "--node-rank 2 is out of range for --nnodes 2 (expected 0..1)"},
        BadInput{"MissingProgram", {"/no/such/program"},
                 "program '/no/such/program' does not exist or is not executable"},
        BadInput{"ProgramNotOnPath", {"no-such-program-xyz"},
                 "program 'no-such-program-xyz' was not found on PATH"},
        BadInput{"UnknownRdzvConf", {"--rdzv-conf", "speed=3", "PROBE"},
                 "--rdzv-conf: unknown key 'speed'"},
        BadInput{"ElasticNeedsEndpoint", {"--rdzv-backend", "c10d", "PROBE"},
                 "--rdzv-backend c10d needs --rdzv-endpoint"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(Launcher, PortInUseFailsFastNamingHostAndPort) {
  HeldPort held;
  const auto port = std::to_string(held.port());
  auto r = launch({"--master-port", port, kProbe, "env"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(Contains(r.output, "127.0.0.1:" + port));
  EXPECT_TRUE(Contains(r.output, "in use"));
  EXPECT_LT(r.took, 3s);
}

TEST(Launcher, UnansweredRendezvousTimesOutNamingTheEndpoint) {
  const auto port = std::to_string(free_port());
  auto r = launch({"--nnodes", "2", "--node-rank", "1", "--master-port", port, "--rdzv-conf",
                   "join_timeout=2", kProbe, "env"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(Contains(r.output, "127.0.0.1:" + port)) << r.output;
  EXPECT_LT(r.took, 10s);
}

TEST(Launcher, MissingNodeIsNamedWhenTheRoundTimesOut) {
  const auto port = std::to_string(free_port());
  auto r = launch({"--nnodes", "2", "--node-rank", "0", "--master-port", port, "--rdzv-conf",
                   "join_timeout=2", kProbe, "env"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(Contains(r.output, "1/2 joined (missing node ranks: 1)")) << r.output;
}

}  // namespace
}  // namespace dtrain::testing
