#pragma once

// The launcher's signals. SIGINT, SIGTERM, SIGHUP and SIGQUIT are caught by a
// handler and handed to one watcher thread, so that every phase — the
// rendezvous, waiting for other nodes, watching the workers, stopping them —
// can ask whether the job was told to stop, and none of them ignores it.
// Every thread the launcher starts blocks them (no call of ours sees EINTR);
// a thread a library started before main() may take one, and the handler
// makes that harmless (with only a blocked mask, the default action there
// would end the launcher without a word).

#include <chrono>
#include <stdexcept>
#include <string>

namespace dtrain::run {

// Installs the handler, blocks the signals in the calling thread and starts
// the watcher; call before starting any thread of ours.
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
