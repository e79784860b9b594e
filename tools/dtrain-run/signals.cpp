#include "signals.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include <condition_variable>
#include <mutex>
#include <thread>

namespace dtrain::run {
namespace {

const int kWatched[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

std::mutex mu;
std::condition_variable cv;
int received = 0;  // guarded by mu

// The handler's only way out: a byte per signal into this pipe, read by the
// watcher thread. Written before the handlers are installed.
int pipe_fds[2] = {-1, -1};
pid_t launcher_pid = 0;

sigset_t watched_set() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : kWatched) sigaddset(&set, s);
  return set;
}

// Async-signal-safe. Runs in whichever thread the kernel picked: the watcher
// (the only one of ours that leaves the signals unblocked) or a thread a
// library started before main() (OpenBLAS starts its pool when it is
// loaded), whose mask we never set. A forked worker between fork() and
// execve() still has this handler: there the signal does what it would
// have done to the worker, and is not reported as the launcher's.
void on_signal(int sig) {
  if (getpid() != launcher_pid) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] auto n = ::write(pipe_fds[1], &byte, 1);
  errno = saved;
}

void watch() {
  const sigset_t set = watched_set();
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  for (;;) {
    unsigned char byte = 0;
    const auto n = ::read(pipe_fds[0], &byte, 1);
    if (n != 1) continue;  // EINTR: the handler ran in this thread
    std::lock_guard<std::mutex> lock(mu);
    if (received == 0) received = byte;  // the first one decides the exit code
    cv.notify_all();
  }
}

}  // namespace

void start_signal_watch() {
  launcher_pid = getpid();
  if (pipe2(pipe_fds, O_CLOEXEC) != 0)
    throw std::runtime_error(std::string("signal pipe: ") + strerror(errno));
  // A flood of signals must not block the handler; one byte is enough to
  // stop, and the first decides the exit code.
  fcntl(pipe_fds[1], F_SETFL, O_NONBLOCK);
  // Blocked in this thread before any of ours starts (they inherit it), so
  // that no blocking call of ours sees EINTR; only the watcher unblocks them.
  const sigset_t set = watched_set();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  struct sigaction action {};
  action.sa_handler = on_signal;
  action.sa_mask = set;  // one handler at a time
  action.sa_flags = SA_RESTART;
  for (int s : kWatched) sigaction(s, &action, nullptr);
  std::thread(watch).detach();
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
