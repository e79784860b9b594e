// DTRAIN_CPU_MEMORY=cache against the malloc settings a user made: each
// case runs in a fresh process (glibc reads MALLOC_*_ and GLIBC_TUNABLES at
// start-up), which applies the policy and then reports what malloc does.

#include <gtest/gtest.h>

#include <malloc.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "common/cpu_memory.h"

namespace dtrain {
namespace {

constexpr const char* kProbeVar = "DTRAIN_TEST_CPU_MEMORY_PROBE";

// Allocates `bytes`, touching it so the call is not optimized away.
char* allocate(size_t bytes) {
  volatile char* p = static_cast<char*>(std::malloc(bytes));
  if (!p) std::abort();
  p[0] = 1;
  p[bytes - 1] = 1;
  return const_cast<char*>(p);
}

bool comes_from_own_mapping(size_t bytes) {
  const size_t before = mallinfo2().hblks;
  char* p = allocate(bytes);
  const bool mapped = mallinfo2().hblks > before;
  std::free(p);
  return mapped;
}

// Whether freeing a 24 MiB block on top of the heap gives memory back.
bool heap_is_trimmed() {
  char* p = allocate(24u << 20);
  const size_t heap = mallinfo2().arena;
  std::free(p);
  return mallinfo2().arena < heap;
}

// The child's side: apply the policy (twice: it must act and speak once),
// print what malloc does, and exit before the tests run.
[[noreturn]] void probe() {
  detail::apply_cpu_memory_policy();
  const std::string policy = detail::apply_cpu_memory_policy();
  const bool own4 = comes_from_own_mapping(4u << 20);
  const bool own100 = comes_from_own_mapping(100u << 20);
  const bool trimmed = heap_is_trimmed();
  std::printf("probe policy=%s own4=%d own100=%d trimmed=%d\n", policy.c_str(), own4, own100,
              trimmed);
  std::fflush(stdout);
  std::_Exit(0);
}

[[maybe_unused]] const bool kProbed = [] {
  if (std::getenv(kProbeVar)) probe();
  return false;
}();

struct Probe {
  std::string output;
  bool own4 = false, own100 = false, trimmed = false;
  int lines = 0;  // "[dtrain] cpu memory:" lines
  std::string line;
};

// Runs this test binary as a probe child with the malloc variables of this
// process removed and `env` added; stdout and stderr together.
Probe run_probe(const std::map<std::string, std::string>& env) {
  std::vector<std::string> vars;
  for (char** e = environ; *e; ++e) {
    const std::string var = *e;
    const std::string name = var.substr(0, var.find('='));
    if (name.rfind("MALLOC_", 0) == 0 || name == "GLIBC_TUNABLES" ||
        name == "DTRAIN_CPU_MEMORY" || name == "DTRAIN_DEBUG")
      continue;
    vars.push_back(var);
  }
  vars.push_back(std::string(kProbeVar) + "=1");
  for (const auto& [name, value] : env) vars.push_back(name + "=" + value);
  std::vector<char*> envp, argv{const_cast<char*>("/proc/self/exe"), nullptr};
  for (auto& v : vars) envp.push_back(v.data());
  envp.push_back(nullptr);

  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 2);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  Probe p;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) p.output.append(buf, n);
  ::close(fds[0]);
  EXPECT_EQ(rc, 0) << "cannot start the probe";
  int status = 0;
  if (rc == 0) ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << p.output;
  p.own4 = p.output.find("own4=1") != std::string::npos;
  p.own100 = p.output.find("own100=1") != std::string::npos;
  p.trimmed = p.output.find("trimmed=1") != std::string::npos;
  EXPECT_NE(p.output.find("probe policy="), std::string::npos) << p.output;
  for (size_t at = 0; (at = p.output.find("[dtrain] cpu memory:", at)) != std::string::npos; ++at) {
    ++p.lines;
    p.line = p.output.substr(at, p.output.find('\n', at) - at);
  }
  return p;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(CpuMemory, CacheKeepsBlocksBelowTheThresholdItReports) {
  const Probe p = run_probe({{"DTRAIN_DEBUG", "INFO"}});
  ASSERT_EQ(p.lines, 1) << p.output;
  EXPECT_TRUE(has(p.output, "probe policy=cache")) << p.output;
  EXPECT_FALSE(p.own4) << p.output;
  EXPECT_FALSE(p.trimmed) << "the cache must never trim: " << p.output;
  EXPECT_TRUE(has(p.line, "heap never trimmed")) << p.line;
  // The threshold it names is the one in force: 100 MiB is below 1 GiB,
  // above the 32 MiB that older glibc is limited to.
  if (has(p.line, "mmap threshold 1 GiB"))
    EXPECT_FALSE(p.own100) << p.output;
  else if (has(p.line, "mmap threshold 32 MiB"))
    EXPECT_TRUE(p.own100) << p.output;
  else
    ADD_FAILURE() << "no threshold named: " << p.line;
}

TEST(CpuMemory, WithoutMallocSettingsTheCacheIsSilent) {
  const Probe p = run_probe({});
  EXPECT_EQ(p.lines, 0) << p.output;
  EXPECT_FALSE(p.own4) << p.output;
}

TEST(CpuMemory, UsersMmapThresholdStaysInForce) {
  for (const auto& [name, value] :
       std::map<std::string, std::string>{{"MALLOC_MMAP_THRESHOLD_", "1048576"},
                                          {"GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=1048576"}}) {
    const Probe p = run_probe({{name, value}});
    EXPECT_TRUE(p.own4) << name << "=" << value << ": 4 MiB must be mapped (above 1 MiB)\n"
                        << p.output;
    EXPECT_EQ(p.lines, 1) << "said once, at every debug level\n" << p.output;
    EXPECT_TRUE(has(p.line, "mmap threshold as you set it")) << p.line;
    EXPECT_TRUE(has(p.line, "heap never trimmed")) << p.line;
    EXPECT_TRUE(has(p.line, value)) << p.line;
  }
}

TEST(CpuMemory, UsersTrimThresholdStaysInForce) {
  const Probe p = run_probe({{"MALLOC_TRIM_THRESHOLD_", "1048576"}});
  EXPECT_TRUE(p.trimmed) << "a freed 24 MiB block above a 1 MiB trim threshold must be trimmed\n"
                         << p.output;
  EXPECT_FALSE(p.own4) << "the mmap threshold is still the cache's\n" << p.output;
  EXPECT_EQ(p.lines, 1) << p.output;
  EXPECT_TRUE(has(p.line, "trim threshold as you set it")) << p.line;
  EXPECT_TRUE(has(p.line, "MALLOC_TRIM_THRESHOLD_=1048576")) << p.line;
}

TEST(CpuMemory, OtherMallocSettingsAreNamedAndTheCacheStillApplies) {
  const Probe p = run_probe({{"MALLOC_ARENA_MAX", "2"}, {"MALLOC_TOP_PAD_", "65536"}});
  EXPECT_FALSE(p.own4) << p.output;
  EXPECT_FALSE(p.trimmed) << p.output;
  EXPECT_EQ(p.lines, 1) << p.output;
  EXPECT_TRUE(has(p.line, "mmap threshold 1 GiB") || has(p.line, "mmap threshold 32 MiB"))
      << p.line;
  EXPECT_TRUE(has(p.line, "MALLOC_ARENA_MAX=2")) << p.line;
  EXPECT_TRUE(has(p.line, "MALLOC_TOP_PAD_=65536")) << p.line;
  // Another allocator's variable is not glibc's: nothing to say.
  const Probe q = run_probe({{"MALLOC_CONF", "narenas:2"}});
  EXPECT_EQ(q.lines, 0) << q.output;
}

TEST(CpuMemory, SystemLeavesMallocAlone) {
  const Probe p = run_probe({{"DTRAIN_CPU_MEMORY", "system"}, {"DTRAIN_DEBUG", "INFO"}});
  EXPECT_TRUE(has(p.output, "probe policy=system")) << p.output;
  EXPECT_TRUE(p.own4) << "glibc's default threshold is 128 KiB\n" << p.output;
  EXPECT_EQ(p.lines, 0) << p.output;
}

}  // namespace
}  // namespace dtrain
