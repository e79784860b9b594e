#include "checkpoint/background.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace dtrain::checkpoint::background {

void Outcome::finish(std::exception_ptr e) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    error = std::move(e);
    done = true;
  }
  finished.notify_all();
}

void Outcome::mark_staged() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    staged = true;
  }
  finished.notify_all();
}

void Outcome::wait_staged() {
  std::unique_lock<std::mutex> lock(mutex);
  finished.wait(lock, [&] { return staged || done; });
}

bool Outcome::outcome_ready() const {
  std::lock_guard<std::mutex> lock(mutex);
  return done;
}

std::exception_ptr Outcome::outcome(bool see) {
  std::unique_lock<std::mutex> lock(mutex);
  finished.wait(lock, [&] { return done; });
  if (see) seen = true;
  return error;
}

std::exception_ptr Outcome::unseen_failure() {
  std::unique_lock<std::mutex> lock(mutex);
  finished.wait(lock, [&] { return done; });
  const bool seen_before = seen;
  seen = true;
  return seen_before ? nullptr : error;
}

void lower_this_threads_priority() {
  const auto tid = static_cast<id_t>(::syscall(SYS_gettid));
  errno = 0;
  const int nice = ::getpriority(PRIO_PROCESS, tid);
  if (errno == 0) ::setpriority(PRIO_PROCESS, tid, std::min(nice + 10, 19));
}

}  // namespace dtrain::checkpoint::background
