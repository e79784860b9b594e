#include "common/cpu_memory.h"

#include <mutex>
#include <sstream>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <unistd.h>  // environ

#include "common/enforce.h"
#include "common/env.h"
#include "common/logging.h"

namespace dtrain::detail {
namespace {

#if defined(__GLIBC__)
// The malloc settings the user made before the process started: glibc's
// MALLOC_* variables and glibc.malloc.* entries of GLIBC_TUNABLES.
struct UserMalloc {
  std::vector<std::string> settings;
  bool mmap_threshold = false;  // MALLOC_MMAP_THRESHOLD_ or glibc.malloc.mmap_threshold
  bool trim_threshold = false;  // MALLOC_TRIM_THRESHOLD_ or glibc.malloc.trim_threshold
};

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

// glibc's environment aliases of its malloc tunables (some end in '_').
bool is_glibc_malloc_variable(const std::string& name) {
  for (const char* known : {"MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST", "MALLOC_CHECK_",
                            "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_PERTURB_",
                            "MALLOC_TOP_PAD_", "MALLOC_TRIM_THRESHOLD_"})
    if (name == known) return true;
  return false;
}

void add_tunables(const std::string& tunables, UserMalloc& user) {
  std::istringstream in(tunables);
  std::string entry;
  while (std::getline(in, entry, ':')) {
    if (!starts_with(entry, "glibc.malloc.")) continue;
    user.settings.push_back("GLIBC_TUNABLES " + entry);
    user.mmap_threshold |= starts_with(entry, "glibc.malloc.mmap_threshold=");
    user.trim_threshold |= starts_with(entry, "glibc.malloc.trim_threshold=");
  }
}

UserMalloc user_malloc() {
  UserMalloc user;
  for (char** e = environ; e && *e; ++e) {
    const std::string var = *e;
    const auto eq = var.find('=');
    const std::string name = var.substr(0, eq);
    if (eq == std::string::npos) continue;
    if (name == "GLIBC_TUNABLES") {
      add_tunables(var.substr(eq + 1), user);
    } else if (is_glibc_malloc_variable(name)) {
      user.settings.push_back(var);
      user.mmap_threshold |= name == "MALLOC_MMAP_THRESHOLD_";
      user.trim_threshold |= name == "MALLOC_TRIM_THRESHOLD_";
    }
  }
  return user;
}

// The largest mmap threshold glibc accepts: 1 GiB on current glibc (2.36,
// Debian 12, measured); older ones refuse anything above HEAP_MAX_SIZE / 2,
// 32 MiB on 64-bit. Returns the threshold set, 0 when both were refused.
int raise_mmap_threshold() {
  for (int bytes : {1 << 30, 32 << 20})
    if (mallopt(M_MMAP_THRESHOLD, bytes) == 1) return bytes;
  return 0;
}

std::string in_mib(int bytes) { return bytes >= (1 << 30) ? "1 GiB" : cat(bytes >> 20, " MiB"); }

// Sets what the user did not set; returns the line saying what is in force,
// or "" when malloc refused.
std::string apply_cache(const UserMalloc& user) {
  std::string mmap = "mmap threshold as you set it", trim = "trim threshold as you set it";
  if (!user.mmap_threshold) {
    const int bytes = raise_mmap_threshold();
    if (bytes == 0) return "";
    mmap = cat("mmap threshold ", in_mib(bytes), " (smaller blocks come from the heap)");
  }
  if (!user.trim_threshold) {
    if (mallopt(M_TRIM_THRESHOLD, -1) != 1) return "";  // -1: never trim (mallopt(3))
    trim = "heap never trimmed";
  }
  std::string line = cat("cpu memory: ", env::kCpuMemory.name, "=cache: malloc ", mmap, ", ",
                         trim);
  if (!user.settings.empty())
    line += cat("; your malloc settings stay in force: ", join(user.settings));
  return line;
}
#endif

std::string decide() {
  const std::string policy = env::get(env::kCpuMemory).value_or("cache");
  DTRAIN_CHECK_ARG(policy == "cache" || policy == "system", "environment variable ",
                   env::kCpuMemory.name, "='", policy, "' is not valid (expected cache or system)");
  if (policy == "system") return policy;
#if defined(__GLIBC__)
  const UserMalloc user = user_malloc();
  const std::string line = apply_cache(user);
  if (line.empty()) {
    log_warning(cat(env::kCpuMemory.name, "=cache: this C library refused malloc's thresholds; "
                    "freed CPU memory is returned to the system as usual"));
    return "system";
  }
  // Said always when the user's own settings change what the cache does.
  if (!user.settings.empty())
    log_line(line);
  else
    DTRAIN_LOG_INFO(line);
  return policy;
#else
  return "system";  // not glibc: its allocator is left as it is
#endif
}

}  // namespace

const std::string& apply_cpu_memory_policy() {
  static std::once_flag once;
  static std::string policy;
  std::call_once(once, [] { policy = decide(); });
  return policy;
}

void return_large_blocks(int bytes) {
  if (apply_cpu_memory_policy() != "cache") return;
#if defined(__GLIBC__)
  static std::once_flag once;
  std::call_once(once, [bytes] {
    if (user_malloc().mmap_threshold) return;
    if (mallopt(M_MMAP_THRESHOLD, bytes) == 1)
      DTRAIN_LOG_INFO(cat("cpu memory: sharded training: blocks of ", in_mib(bytes),
                          " or more are mapped and returned to the system when freed"));
  });
#else
  (void)bytes;
#endif
}

}  // namespace dtrain::detail
