#include "signals.h"

#include <signal.h>
#include <string.h>

#include <condition_variable>
#include <mutex>
#include <thread>

namespace dtrain::run {
namespace {

const int kWatched[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

std::mutex mu;
std::condition_variable cv;
int received = 0;  // guarded by mu

sigset_t watched_set() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : kWatched) sigaddset(&set, s);
  return set;
}

}  // namespace

void start_signal_watch() {
  const sigset_t set = watched_set();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    for (;;) {
      int sig = 0;
      if (sigwait(&set, &sig) != 0) continue;
      std::lock_guard<std::mutex> lock(mu);
      if (received == 0) received = sig;  // the first one decides the exit code
      cv.notify_all();
    }
  }).detach();
}

int pending_signal() {
  std::lock_guard<std::mutex> lock(mu);
  return received;
}

int wait_signal(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu);
  cv.wait_for(lock, timeout, [] { return received != 0; });
  return received;
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

}  // namespace dtrain::run
