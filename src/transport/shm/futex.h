#pragma once

// Futexes on words in shared memory (not FUTEX_PRIVATE: the word is mapped
// in several processes), and a CPU pause for spin loops. No torch here.

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DTRAIN_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define DTRAIN_CPU_RELAX() asm volatile("yield")
#else
#define DTRAIN_CPU_RELAX() ((void)0)
#endif

namespace dtrain::shm {

static_assert(std::atomic<uint32_t>::is_always_lock_free);

// Sleeps while `word` holds `seen`, at most `timeout` (or until woken).
inline void futex_wait(std::atomic<uint32_t>& word, uint32_t seen,
                       std::chrono::nanoseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000000000),
              static_cast<long>(timeout.count() % 1000000000)};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>& word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr,
            0);
}

}  // namespace dtrain::shm
