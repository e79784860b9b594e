#pragma once

// The launcher's signals. SIGINT, SIGTERM, SIGHUP and SIGQUIT are blocked in
// every thread and taken by one watcher thread, so that every phase — the
// rendezvous, waiting for other nodes, watching the workers, stopping them —
// can ask whether the job was told to stop, and none of them ignores it.

#include <chrono>
#include <stdexcept>
#include <string>

namespace dtrain::run {

// Blocks the signals and starts the watcher; call before any other thread.
void start_signal_watch();
// The first signal received so far, or 0.
int pending_signal();
// Waits up to `timeout` for a signal; returns it (or one already received), else 0.
int wait_signal(std::chrono::milliseconds timeout);
// "SIGTERM"
std::string signal_name(int sig);

// Thrown by a phase that stops because the launcher was signalled.
class Interrupted : public std::runtime_error {
 public:
  explicit Interrupted(int sig)
      : std::runtime_error("received " + signal_name(sig)), signal(sig) {}
  int signal;
};

// Throws Interrupted when a signal has arrived.
inline void throw_if_signalled() {
  if (int sig = pending_signal()) throw Interrupted(sig);
}

}  // namespace dtrain::run
