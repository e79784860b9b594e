#include "common/cpu_memory.h"

#include <mutex>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "common/enforce.h"
#include "common/env.h"
#include "common/logging.h"

namespace dtrain::detail {
namespace {

std::string decide() {
  const std::string policy = env::get(env::kCpuMemory).value_or("cache");
  DTRAIN_CHECK_ARG(policy == "cache" || policy == "system", "environment variable ",
                   env::kCpuMemory.name, "='", policy, "' is not valid (expected cache or system)");
  if (policy == "system") return policy;
#if defined(__GLIBC__)
  // Older glibc caps the threshold at 32 MiB (HEAP_MAX_SIZE / 2); take the
  // largest it accepts. -1 disables trimming (documented by mallopt(3)).
  const bool mapped = mallopt(M_MMAP_THRESHOLD, 1 << 30) == 1 ||
                      mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
  const bool untrimmed = mallopt(M_TRIM_THRESHOLD, -1) == 1;
  if (!mapped || !untrimmed) {
    log_warning(cat(env::kCpuMemory.name, "=cache: this C library refused malloc's thresholds; "
                    "freed CPU memory is returned to the system as usual"));
    return "system";
  }
  DTRAIN_LOG_INFO("cpu memory: freed tensor memory stays in the process for reuse (",
                  env::kCpuMemory.name, "=cache)");
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

}  // namespace dtrain::detail
