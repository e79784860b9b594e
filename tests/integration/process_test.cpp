// Ranks as real processes: env:// over the TCP store, bad environments,
// ranks that never join, peers killed or stopped mid-collective, and
// PyTorch's own torchrun as the launcher.

#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <functional>

#include "common/paths.h"
#include "harness/process_ranks.h"
#include "harness/temp_dir.h"
#include "common/slurm.h"

namespace dtrain::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const std::string kWorker = DTRAIN_TEST_WORKER;


// Runs `world` collectives ranks with per-rank environments and extra args.
void expect_collectives_pass(int world, const std::function<std::map<std::string, std::string>(int)>& env,
                             const std::vector<std::string>& extra_args = {}) {
  ProcessRanks procs;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> argv = {kWorker, "collectives"};
    argv.insert(argv.end(), extra_args.begin(), extra_args.end());
    procs.spawn(argv, env(r));
  }
  ASSERT_TRUE(procs.wait_all(90s)) << "ranks did not finish";
  for (int r = 0; r < world; ++r) {
    auto& p = procs.ranks()[r];
    EXPECT_EQ(p.exit_code, 0) << "rank " << r << ": " << describe(p);
    EXPECT_NE(p.output().find("rank " + std::to_string(r) + " ok"), std::string::npos)
        << describe(p);
  }
}

class EnvInit : public ::testing::TestWithParam<int> {};

TEST_P(EnvInit, CollectivesAndSubgroupOverTcpStore) {
  const int world = GetParam();
  const int port = free_port();
  expect_collectives_pass(world, [&](int r) { return rank_env(r, world, port); });
}

INSTANTIATE_TEST_SUITE_P(World, EnvInit, ::testing::Values(1, 2, 3, 4));

TEST(InitMethods, TcpUrl) {
  const int port = free_port();
  expect_collectives_pass(3, [](int r) {
    return std::map<std::string, std::string>{{"RANK", std::to_string(r)}, {"WORLD_SIZE", "3"}};
  }, {"tcp://127.0.0.1:" + std::to_string(port)});
}

TEST(InitMethods, FileUrl) {
  char dir[] = "/tmp/dtrain-file-init-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/store";
  expect_collectives_pass(3, [](int r) {
    return std::map<std::string, std::string>{{"RANK", std::to_string(r)}, {"WORLD_SIZE", "3"}};
  }, {"file://" + path});
  EXPECT_NE(access(path.c_str(), F_OK), 0) << "the last FileStore user should remove " << path;
  rmdir(dir);
}

TEST(InitMethods, OpenMpiVariablesWithoutRank) {
  const int port = free_port();
  expect_collectives_pass(2, [port](int r) {
    auto env = rank_env(r, 2, port);
    env.erase("RANK");
    env.erase("WORLD_SIZE");
    env["OMPI_COMM_WORLD_RANK"] = std::to_string(r);
    env["OMPI_COMM_WORLD_SIZE"] = "2";
    return env;
  });
}

TEST(InitMethods, SlurmVariablesWithoutRank) {
  const int port = free_port();
  expect_collectives_pass(2, [port](int r) {
    auto env = rank_env(r, 2, port);
    env.erase("RANK");
    env.erase("WORLD_SIZE");
    env["SLURM_PROCID"] = std::to_string(r);
    env["SLURM_NTASKS"] = "2";
    return env;
  });
}

// srun without MASTER_ADDR/MASTER_PORT: the host is the step's first node
// and the port comes from the job and step ids (the job id is chosen so
// that the port is one that was free a moment ago).
TEST(InitMethods, SlurmWithoutMasterAddrOrPort) {
  int port = free_port();
  while (port < 15000 || port >= 55000) port = free_port();
  long long job = 1;
  while (slurm::rendezvous_port(job, 7) != port) ++job;
  expect_collectives_pass(2, [job](int r) {
    auto env = rank_env(r, 2, 1);
    for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) env.erase(name);
    env["SLURM_PROCID"] = std::to_string(r);
    env["SLURM_NTASKS"] = "2";
    env["SLURM_STEP_NODELIST"] = "localhost,node-[2-9]";
    env["SLURM_JOB_NODELIST"] = "no-such-node[1-9]";
    env["SLURM_JOB_ID"] = std::to_string(job);
    env["SLURM_STEP_ID"] = "7";
    return env;
  });
}

struct BadEnvCase {
  const char* name;
  std::map<std::string, std::string> env;
  const char* message;
};

void PrintTo(const BadEnvCase& c, std::ostream* os) { *os << c.name; }

class BadEnvironment : public ::testing::TestWithParam<BadEnvCase> {};

TEST_P(BadEnvironment, FailsAtOnceNamingTheVariable) {
  auto env = rank_env(0, 1, free_port());
  for (const auto& [k, v] : GetParam().env) {
    if (v == "<unset>") {
      env.erase(k);
      unsetenv(k.c_str());  // not inherited either
    } else {
      env[k] = v;
    }
  }
  ProcessRanks procs;
  auto& p = procs.spawn({kWorker, "init"}, env);
  ASSERT_TRUE(procs.wait(p, Clock::now() + 15s)) << "init hung with a bad environment";
  EXPECT_EQ(p.exit_code, 2) << describe(p);
  EXPECT_NE(p.output().find(GetParam().message), std::string::npos) << describe(p);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BadEnvironment,
    ::testing::Values(
        BadEnvCase{"RankNotBelowWorld", {{"RANK", "4"}, {"WORLD_SIZE", "4"}},
                   "caught InvalidArgument: rank 4 is out of range for world size 4 (expected 0..3)"},
        BadEnvCase{"WorldZero", {{"WORLD_SIZE", "0"}},
                   "caught InvalidArgument: environment variable WORLD_SIZE=0 is out of range"},
        BadEnvCase{"RankNotANumber", {{"RANK", "one"}},
                   "caught InvalidArgument: environment variable RANK='one' is not an integer"},
        BadEnvCase{"PortTooLarge", {{"MASTER_PORT", "70000"}},
                   "caught InvalidArgument: MASTER_PORT=70000 is not a valid port"},
        BadEnvCase{"HostDoesNotResolve", {{"MASTER_ADDR", "no-such-host.invalid"}},
                   "caught InvalidArgument: MASTER_ADDR=no-such-host.invalid does not resolve"},
        BadEnvCase{"MasterAddrUnset", {{"MASTER_ADDR", "<unset>"}},
                   "caught InvalidArgument: init_method env:// needs MASTER_ADDR"},
        BadEnvCase{"SlurmNodelistMalformed",
                   {{"MASTER_ADDR", "<unset>"}, {"SLURM_STEP_NODELIST", "n[1-"}},
                   "caught InvalidArgument: SLURM_STEP_NODELIST='n[1-': unbalanced '[' in 'n[1-'"},
        BadEnvCase{"SlurmNodeDoesNotResolve",
                   {{"MASTER_ADDR", "<unset>"}, {"SLURM_STEP_NODELIST", "no-such-node[1-2].invalid"}},
                   "caught InvalidArgument: SLURM_STEP_NODELIST's first node=no-such-node1.invalid "
                   "does not resolve"},
        BadEnvCase{"TimeoutNotANumber", {{"DTRAIN_TIMEOUT", "soon"}},
                   "environment variable DTRAIN_TIMEOUT='soon' is not an integer"},
        BadEnvCase{"CpuMemoryUnknown", {{"DTRAIN_CPU_MEMORY", "fast"}},
                   "caught InvalidArgument: environment variable DTRAIN_CPU_MEMORY='fast' is not "
                   "valid (expected cache or system)"}),
    [](const auto& info) { return std::string(info.param.name); });

// The fewest minor page faults of any 5 consecutive SGD steps after step 10
// (of `steps`) on 64 MiB tensors in a process after init_process_group().
// The three workers of the test share one deadline: alone they take about
// 100 s together here, and twice that beside other tests on 2 cores (a
// bound of 90 s each failed so); 280 s stays under the case's ctest timeout
// (300 s) and still ends a stalled worker.
long faults_with_cpu_memory(const std::string& policy, int steps, Clock::time_point deadline) {
  auto env = rank_env(0, 1, free_port());
  if (!policy.empty()) env["DTRAIN_CPU_MEMORY"] = policy;
  env["OMP_NUM_THREADS"] = "1";
  ProcessRanks procs;
  auto& p = procs.spawn({kWorker, "page-faults", std::to_string(steps)}, env);
  EXPECT_TRUE(procs.wait(p, deadline)) << "page-faults worker (" << policy << ") hung";
  EXPECT_EQ(p.exit_code, 0) << describe(p);
  const auto at = p.output().find("faults ");
  EXPECT_NE(at, std::string::npos) << describe(p);
  return at == std::string::npos ? -1 : std::stol(p.output().substr(at + 7));
}

TEST(CpuMemory, TrainingStepsReuseFreedMemoryWithoutPageFaults) {
  // glibc's defaults map blocks above its mmap threshold afresh each time;
  // the threshold rises with the blocks freed, up to 32 MiB, so 64 MiB
  // tensors stay above it: every step faults in its temporaries (about
  // 115,000 faults a step measured). The cache serves them from memory the
  // process kept. Its heap may still grow now and then, its free blocks
  // fragmented by small objects, and fault in a tensor or two: CI once saw
  // two tensors' pages in 10 steps. Steady steps fault none, so the bound
  // is on the quietest 5-step window (0 faults measured), not on a fixed
  // one.
  const long tensor_pages = (64L << 20) / sysconf(_SC_PAGESIZE);
  const auto deadline = Clock::now() + 280s;
  // Under glibc's defaults every step faults: one window (steps 10-15)
  // shows it, where each step costs about 115,000 faults, which on these
  // virtual machines is most of the test's time.
  const long system = faults_with_cpu_memory("system", 15, deadline);
  const long cached = faults_with_cpu_memory("", 30, deadline);  // the default: cache
  EXPECT_GT(system, 2 * tensor_pages) << "DTRAIN_CPU_MEMORY=system must leave malloc as glibc has it";
  EXPECT_GE(cached, 0);
  EXPECT_LE(cached, tensor_pages / 8)
      << "DTRAIN_CPU_MEMORY=cache (the default): " << cached
      << " page faults in the quietest 5 steps, against " << system << " with system";
  // The same policy named: fewer steps (its windows, not its length, matter).
  const long explicit_cache = faults_with_cpu_memory("cache", 20, deadline);
  EXPECT_GE(explicit_cache, 0);
  EXPECT_LE(explicit_cache, tensor_pages / 8);
}

// Under the cache (the default), the heap keeps every block below 1 GiB;
// once FSDP is built, blocks of 32 MiB or more are mapped and go back to the
// system when freed again, so that FSDP's peak memory is what it holds.
TEST(CpuMemory, FsdpReturnsLargeBlocksToTheSystem) {
  for (const std::string policy : {"", "system"}) {
    auto env = rank_env(0, 1, free_port());
    if (!policy.empty()) env["DTRAIN_CPU_MEMORY"] = policy;
    ProcessRanks procs;
    auto& p = procs.spawn({kWorker, "fsdp-malloc"}, env);
    ASSERT_TRUE(procs.wait(p, Clock::now() + 60s)) << "fsdp-malloc worker hung";
    ASSERT_EQ(p.exit_code, 0) << describe(p);
    long long before = -1, after = -1;
    ASSERT_EQ(std::sscanf(p.output().c_str() + p.output().find("mapped "), "mapped %lld %lld", &before,
                          &after), 2) << describe(p);
    const long long block = 48LL << 20;
    if (policy.empty()) {
      EXPECT_EQ(before, 0) << "the cache serves a 48 MiB block from the heap";
      EXPECT_GE(after, block) << "after FSDP, a 48 MiB block is mapped";
    } else {
      EXPECT_GE(before, block) << "glibc maps 48 MiB blocks";
      EXPECT_GE(after, block);
    }
  }
}

TEST(ProcessFailures, MissingRankIsNamedWhenJoinTimesOut) {
  const int port = free_port();
  ProcessRanks procs;
  for (int r = 0; r < 2; ++r) procs.spawn({kWorker, "init"}, rank_env(r, 3, port, "2"));
  ASSERT_TRUE(procs.wait_all(30s));
  for (auto& p : procs.ranks()) {
    EXPECT_EQ(p.exit_code, 2) << describe(p);
    EXPECT_NE(p.output().find("caught TimeoutError"), std::string::npos) << describe(p);
    EXPECT_NE(p.output().find("2/3 joined (missing ranks: 2)"), std::string::npos) << describe(p);
  }
}

TEST(ProcessFailures, PortInUseFailsFastNamingHostAndPort) {
  HeldPort held;
  const int port = held.port();
  ProcessRanks procs;
  auto& p = procs.spawn({kWorker, "init"}, rank_env(0, 2, port));
  ASSERT_TRUE(procs.wait(p, Clock::now() + 15s)) << "init hung on a port in use";
  EXPECT_EQ(p.exit_code, 2) << describe(p);
  EXPECT_NE(p.output().find("caught NetworkError"), std::string::npos) << describe(p);
  EXPECT_NE(p.output().find("127.0.0.1:" + std::to_string(port)), std::string::npos)
      << describe(p);
}

TEST(ProcessFailures, UnreachableStoreTimesOutNamingHostAndPort) {
  const int port = free_port();  // nothing listens there
  ProcessRanks procs;
  auto start = Clock::now();
  auto& p = procs.spawn({kWorker, "init"}, rank_env(1, 2, port, "2"));
  ASSERT_TRUE(procs.wait(p, Clock::now() + 20s));
  EXPECT_EQ(p.exit_code, 2) << describe(p);
  EXPECT_NE(p.output().find("caught TimeoutError"), std::string::npos) << describe(p);
  EXPECT_NE(p.output().find("127.0.0.1:" + std::to_string(port)), std::string::npos)
      << describe(p);
  EXPECT_LT(p.end - start, 10s);
}

// Names in /dev/shm that an shm group of these processes could have left.
std::vector<std::string> shm_leftovers(ProcessRanks& procs) {
  std::vector<std::string> found;
  for (const auto& name : dtrain::paths::list("/dev/shm")) {
    for (const auto& p : procs.ranks())
      if (name.rfind("dtrain-shm." + std::to_string(p.pid) + ".", 0) == 0) found.push_back(name);
  }
  return found;
}

// Starts `world` looping ranks and waits until each has initialized;
// host_ids[r], where given, is rank r's DTRAIN_HOST_ID.
void start_loop(ProcessRanks& procs, int world, const std::string& timeout_s,
                const std::string& backend, const std::string& mode = "loop",
                const std::vector<std::string>& host_ids = {}) {
  const int port = free_port();
  for (int r = 0; r < world; ++r) {
    auto env = rank_env(r, world, port, timeout_s);
    if (!host_ids.empty()) env["DTRAIN_HOST_ID"] = host_ids[r];
    procs.spawn({kWorker, mode, backend}, env);
  }
  for (int r = 0; r < world; ++r)
    ASSERT_TRUE(procs.wait_for_output(procs.ranks()[r], "ready", 60s))
        << "rank " << r << " never became ready: " << describe(procs.ranks()[r]);
}

// The same failures on the default backend (auto: shm on one machine) and
// on gloo.
class PeerFailure : public ::testing::TestWithParam<std::string> {};

TEST_P(PeerFailure, KilledPeerBecomesAnErrorOnEverySurvivor) {
  const auto timeout = 4s;
  ProcessRanks procs;
  start_loop(procs, 3, "4", GetParam());
  // shm unlinks its segment as soon as every rank has mapped it: while the
  // job runs there is already nothing that a crash could leave behind.
  EXPECT_EQ(shm_leftovers(procs), std::vector<std::string>{});
  auto killed_at = Clock::now();
  kill(procs.ranks()[1].pid, SIGKILL);
  ASSERT_TRUE(procs.wait_all(2 * timeout + 10s)) << "a survivor hung after its peer was killed";
  for (int r : {0, 2}) {
    auto& p = procs.ranks()[r];
    EXPECT_EQ(p.exit_code, 3) << describe(p);
    EXPECT_NE(p.output().find("caught "), std::string::npos) << describe(p);
    EXPECT_LE(p.end - killed_at, 2 * timeout) << describe(p);
    if (GetParam() == "auto") {
      // shm sees the dead peer's liveness lock go, well before the timeout.
      EXPECT_NE(p.output().find("caught NetworkError: all_reduce #"), std::string::npos)
          << describe(p);
      EXPECT_NE(p.output().find("exited, was killed, or destroyed the group"), std::string::npos)
          << describe(p);
      EXPECT_LT(p.end - killed_at, timeout / 2) << describe(p);
    }
  }
  EXPECT_EQ(shm_leftovers(procs), std::vector<std::string>{});
}

TEST_P(PeerFailure, StoppedPeerBecomesTimeoutErrorWithinTheTimeout) {
  const auto timeout = 4s;
  ProcessRanks procs;
  start_loop(procs, 2, "4", GetParam());
  auto stopped_at = Clock::now();
  kill(procs.ranks()[1].pid, SIGSTOP);
  auto& survivor = procs.ranks()[0];
  ASSERT_TRUE(procs.wait(survivor, Clock::now() + 2 * timeout + 10s))
      << "the survivor hung after its peer was stopped";
  EXPECT_EQ(survivor.exit_code, 3) << describe(survivor);
  EXPECT_NE(survivor.output().find("caught TimeoutError"), std::string::npos) << describe(survivor);
  EXPECT_GE(survivor.end - stopped_at, timeout / 2) << describe(survivor);
  EXPECT_LE(survivor.end - stopped_at, 2 * timeout) << describe(survivor);
  kill(procs.ranks()[1].pid, SIGKILL);
  procs.wait_all(10s);
  EXPECT_EQ(shm_leftovers(procs), std::vector<std::string>{});
}

INSTANTIATE_TEST_SUITE_P(Backends, PeerFailure, ::testing::Values("auto", "tcp"));

// auto over two host ids: a killed rank is a dead ring to its own host's
// rank (its liveness lock goes) and closed sockets to the other host's; every
// survivor hears of it well before the timeout.
TEST(AutoOverHosts, KilledPeerBecomesAnErrorOnEverySurvivor) {
  const auto timeout = 6s;
  ProcessRanks procs;
  start_loop(procs, 4, "6", "auto", "loop", {"a", "a", "b", "b"});
  for (int r = 0; r < 4; ++r)
    ASSERT_TRUE(procs.wait_for_output(procs.ranks()[r], "steps 200", 30s)) << describe(procs.ranks()[r]);
  const auto killed_at = Clock::now();
  kill(procs.ranks()[1].pid, SIGKILL);
  ASSERT_TRUE(procs.wait_all(2 * timeout + 10s)) << "a survivor hung after its peer was killed";
  for (int r : {0, 2, 3}) {
    auto& p = procs.ranks()[r];
    EXPECT_EQ(p.exit_code, 3) << describe(p);
    // Whichever link it heard from first: rank 1's ring or socket, or a
    // survivor that failed before it.
    EXPECT_NE(p.output().find("caught NetworkError: "), std::string::npos) << describe(p);
    EXPECT_NE(p.output().find("(the peer may have exited or been killed)"), std::string::npos)
        << describe(p);
    EXPECT_LT(p.end - killed_at, timeout / 2) << describe(p);
  }
  EXPECT_EQ(shm_leftovers(procs), std::vector<std::string>{});
}

// shm's send/recv run over rings in shared memory: a killed peer's
// liveness lock goes, and the survivors hear of it well before the timeout.
TEST(ShmPointToPoint, KilledPeerBecomesAnErrorOnEverySurvivor) {
  const auto timeout = 6s;
  ProcessRanks procs;
  start_loop(procs, 3, "6", "shm", "p2p-loop");
  for (int r = 0; r < 3; ++r)
    ASSERT_TRUE(procs.wait_for_output(procs.ranks()[r], "steps 200", 30s)) << describe(procs.ranks()[r]);
  const auto killed_at = Clock::now();
  kill(procs.ranks()[1].pid, SIGKILL);
  ASSERT_TRUE(procs.wait_all(2 * timeout + 10s)) << "a survivor hung after its peer was killed";
  for (int r : {0, 2}) {
    auto& p = procs.ranks()[r];
    EXPECT_EQ(p.exit_code, 3) << describe(p);
    EXPECT_NE(p.output().find("caught NetworkError"), std::string::npos) << describe(p);
    // Rank 2 waited for rank 1; rank 0 may hear first of rank 2 giving up.
    EXPECT_NE(p.output().find(r == 2 ? "shm: rank 1 (pid " : "shm: rank "), std::string::npos)
        << describe(p);
    EXPECT_NE(p.output().find("(the peer may have exited or been killed)"), std::string::npos)
        << describe(p);
    EXPECT_LT(p.end - killed_at, timeout / 2) << describe(p);
  }
  EXPECT_EQ(shm_leftovers(procs), std::vector<std::string>{});
}

TEST(ShmCleanup, NothingLeftInDevShmAfterNormalExitOrError) {
  {
    ProcessRanks procs;
    const int port = free_port();
    for (int r = 0; r < 3; ++r) procs.spawn({kWorker, "collectives", "env://", "shm"}, rank_env(r, 3, port, "30"));
    ASSERT_TRUE(procs.wait_all(60s));
    for (auto& p : procs.ranks()) EXPECT_EQ(p.exit_code, 0) << describe(p);
    EXPECT_EQ(shm_leftovers(procs), std::vector<std::string>{});
  }
  {
    // An error: mismatched collectives (caught by shm itself, no DETAIL).
    ProcessRanks procs;
    const int port = free_port();
    for (int r = 0; r < 2; ++r) procs.spawn({kWorker, "mismatch"}, rank_env(r, 2, port, "20"));
    ASSERT_TRUE(procs.wait_all(60s));
    for (auto& p : procs.ranks()) {
      EXPECT_EQ(p.exit_code, 3) << describe(p);
      EXPECT_NE(p.output().find("caught CollectiveMismatch: shm: ranks called different "
                                "collectives at "),
                std::string::npos) << describe(p);
      EXPECT_NE(p.output().find("rank 0: all_reduce #0(Float, 8 elements, SUM)"),
                std::string::npos) << describe(p);
      EXPECT_NE(p.output().find("rank 1: broadcast #0(Float, 8 elements, root 0)"),
                std::string::npos) << describe(p);
    }
    EXPECT_EQ(shm_leftovers(procs), std::vector<std::string>{});
  }
}

TEST(ProcessFailures, DebugDetailFromTheEnvironmentNamesMismatchedRanks) {
  const int port = free_port();
  ProcessRanks procs;
  for (int r = 0; r < 2; ++r) {
    auto env = rank_env(r, 2, port, "20");
    env["DTRAIN_DEBUG"] = "DETAIL";
    procs.spawn({kWorker, "mismatch"}, env);
  }
  ASSERT_TRUE(procs.wait_all(60s));
  for (auto& p : procs.ranks()) {
    EXPECT_EQ(p.exit_code, 3) << describe(p);
    EXPECT_NE(p.output().find("caught CollectiveMismatch"), std::string::npos) << describe(p);
    EXPECT_NE(p.output().find("rank 1: broadcast #0 (dtype Float, shape [8], root 0)"),
              std::string::npos) << describe(p);
  }
}

TEST(ProcessDDP, ThreeRanksEndWithIdenticalParametersAndLogStats) {
  const int port = free_port();
  ProcessRanks procs;
  for (int r = 0; r < 3; ++r) {
    auto env = rank_env(r, 3, port);
    env["DTRAIN_DEBUG"] = "INFO";
    procs.spawn({kWorker, "ddp"}, env);
  }
  ASSERT_TRUE(procs.wait_all(90s));
  std::string checksum;
  for (int r = 0; r < 3; ++r) {
    auto& p = procs.ranks()[r];
    ASSERT_EQ(p.exit_code, 0) << describe(p);
    auto out = p.output();
    auto at = out.find("rank " + std::to_string(r) + " params ");
    ASSERT_NE(at, std::string::npos) << describe(p);
    auto value = out.substr(at + 14, out.find('\n', at) - at - 14);
    if (r == 0) checksum = value;
    EXPECT_EQ(value, checksum) << "rank " << r << " diverged";
    EXPECT_NE(out.find("ddp: iteration 3: backward"), std::string::npos) << describe(p);
  }
}

// PyTorch's torchrun (Debian python3-torch) as the launcher: with its
// default static rendezvous the agent hosts the store
// (TORCHELASTIC_USE_AGENT_STORE=True); with --standalone rank 0 hosts it.
class Torchrun : public ::testing::TestWithParam<bool> {};

TEST_P(Torchrun, FourRanksRunUnchanged) {
  // Debian's torchrun 1.13 on Python 3.11 cannot parse its default
  // --redirects/--tee of 0 (enum.Flag no longer iterates NONE); any value
  // of 1 or 2 works, so tee stderr.
  // torchrun's main() through launcher/torchrun.py: Debian's 2.6 and 2.14
  // torchrun cannot start without it (its rendezvous insists on libuv).
  std::vector<std::string> argv = {TORCHRUN_PYTHON, TORCHRUN_SHIM, "--redirects", "2", "--tee", "2",
                                   "--nproc_per_node", "4"};
  if (GetParam()) {
    argv.push_back("--standalone");
  } else {
    argv.push_back("--master_port");
    argv.push_back(std::to_string(free_port()));
  }
  for (const char* a : {"--no_python", kWorker.c_str(), "collectives"}) argv.push_back(a);
  ProcessRanks procs;
  auto& p = procs.spawn(argv, {{"DTRAIN_TIMEOUT", "60"}, {"OMP_NUM_THREADS", "1"}, {"USE_LIBUV", "0"}});
  ASSERT_TRUE(procs.wait(p, Clock::now() + 120s)) << "torchrun did not finish: " << p.output();
  EXPECT_EQ(p.exit_code, 0) << describe(p);
  for (int r = 0; r < 4; ++r)
    EXPECT_NE(p.output().find("rank " + std::to_string(r) + " ok"), std::string::npos)
        << describe(p);
}

// A rank killed while saving a distributed checkpoint (in its data file,
// or after every data file but before the commit), or at any point of an
// asynchronous save (staging, the background writer's file, its commit),
// leaves the previous checkpoint loadable, values and metadata.
class CheckpointCrash : public ::testing::TestWithParam<std::string> {};

TEST_P(CheckpointCrash, ThePreviousCheckpointStaysLoadable) {
  TempDir dir;
  ProcessRanks procs;
  auto& crash = procs.spawn({kWorker, "checkpoint-crash", dir.path(), GetParam()},
                            rank_env(0, 1, free_port()));
  ASSERT_TRUE(procs.wait(crash, Clock::now() + 60s)) << crash.output();
  EXPECT_EQ(crash.signal, SIGKILL) << describe(crash);
  EXPECT_NE(crash.output().find("saving checkpoint 2"), std::string::npos) << describe(crash);
  auto& check = procs.spawn({kWorker, "checkpoint-check", dir.path()}, rank_env(0, 1, free_port()));
  ASSERT_TRUE(procs.wait(check, Clock::now() + 60s)) << check.output();
  EXPECT_EQ(check.exit_code, 0) << describe(check);
  EXPECT_NE(check.output().find("checkpoint 1 intact"), std::string::npos) << describe(check);
}
INSTANTIATE_TEST_SUITE_P(Phases, CheckpointCrash,
                         ::testing::Values("writing", "commit", "async-staging", "async-writing", "async-commit"),
                         [](const auto& info) {
                           auto name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// FSDP through the launcher on the network, shared-memory and automatic
// backends: every rank equals one process on the whole batch.
class FsdpLaunched : public ::testing::TestWithParam<std::string> {};

TEST_P(FsdpLaunched, ThreeRanksMatchSingleProcessTraining) {
  ProcessRanks procs;
  auto& run = procs.spawn({DTRAIN_RUN_EXECUTABLE, "--nproc-per-node", "3", "--master-port",
                           std::to_string(free_port()), kWorker, "fsdp-equivalence", GetParam()},
                          {});
  ASSERT_TRUE(procs.wait(run, Clock::now() + 120s)) << "dtrain-run did not finish: " << run.output();
  EXPECT_EQ(run.exit_code, 0) << describe(run);
  for (int r = 0; r < 3; ++r)
    EXPECT_NE(run.output().find("rank " + std::to_string(r) + " fsdp matches single-process training on "),
              std::string::npos) << describe(run);
}
// Each rank builds its model under a ShardedConstruction from its own seed
// (units sharded as they are built): rank 0's values are everyone's.
TEST_P(FsdpLaunched, ShardedConstructionMatchesSingleProcessTraining) {
  ProcessRanks procs;
  auto& run = procs.spawn({DTRAIN_RUN_EXECUTABLE, "--nproc-per-node", "3", "--master-port",
                           std::to_string(free_port()), kWorker, "fsdp-sharded-construction", GetParam()},
                          {});
  ASSERT_TRUE(procs.wait(run, Clock::now() + 120s)) << "dtrain-run did not finish: " << run.output();
  EXPECT_EQ(run.exit_code, 0) << describe(run);
  for (int r = 0; r < 3; ++r)
    EXPECT_NE(run.output().find("rank " + std::to_string(r) +
                                " fsdp (sharded construction) matches single-process training on "),
              std::string::npos) << describe(run);
}
INSTANTIATE_TEST_SUITE_P(Backends, FsdpLaunched, ::testing::Values("tcp", "shm", "auto"));

// ZeRO-1 (ZeroRedundancyOptimizer under DDP) and ZeRO-2 (DDP
// reduce-scattering its buckets, the optimizer over it) through the
// launcher: every rank equals one process on the whole batch.
class ZeroLaunched : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(ZeroLaunched, ThreeRanksMatchSingleProcessTraining) {
  const auto [backend, stage] = GetParam();
  const std::string name = "zero" + std::to_string(stage);
  ProcessRanks procs;
  auto& run = procs.spawn({DTRAIN_RUN_EXECUTABLE, "--nproc-per-node", "3", "--master-port",
                           std::to_string(free_port()), kWorker, name + "-equivalence", backend},
                          {});
  ASSERT_TRUE(procs.wait(run, Clock::now() + 120s)) << "dtrain-run did not finish: " << run.output();
  EXPECT_EQ(run.exit_code, 0) << describe(run);
  for (int r = 0; r < 3; ++r)
    EXPECT_NE(run.output().find("rank " + std::to_string(r) + " " + name +
                                " matches single-process training on "),
              std::string::npos) << describe(run);
}
INSTANTIATE_TEST_SUITE_P(Backends, ZeroLaunched,
                         ::testing::Combine(::testing::Values("tcp", "shm", "auto"),
                                            ::testing::Values(1, 2)));

INSTANTIATE_TEST_SUITE_P(Rendezvous, Torchrun, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Standalone" : "AgentStore"; });

}  // namespace
}  // namespace dtrain::testing
