#pragma once

// Finishes the Works of point-to-point operations each as soon as its own
// operation is done, in whatever order that happens: a send's Work does not
// wait for a receive posted before it (process_group.h: each send and recv
// completes on its own; only collectives run in issue order). One thread
// per group tests what is outstanding when told something finished
// (notify(), from a transport's on_done hook), every `poll` interval for
// sources that cannot tell (MPI), and at each operation's deadline.
// An operation's deadline is its timeout after its Work is first waited
// on (work.h): until then it has none, so a receive posted long before it
// is needed (a pipeline's) does not time out while nobody waits for it.
// Works' callbacks run on that thread, never on a transport's.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "dtrain/work.h"

namespace dtrain {

class CompletionWatcher {
 public:
  using Clock = std::chrono::steady_clock;

  struct Op {
    WorkPtr work;
    // Without blocking: true once the operation is done (then it throws its
    // error, if it failed).
    std::function<bool()> test;
    // The deadline passed with test() false: throws the timeout (and may
    // break the group).
    std::function<void(Clock::time_point deadline)> expire;
    // Counted from the Work's first wait.
    Clock::duration timeout{};
    // close() ends the operation while it is still pending: lets go of it
    // (cancels it where the source can). May be empty.
    std::function<void()> abandon;
  };

  // `poll`: how often to test without being told; zero: only when told.
  explicit CompletionWatcher(std::chrono::microseconds poll = std::chrono::microseconds(0));
  // Without close(): waits for every operation to finish or expire.
  ~CompletionWatcher();
  CompletionWatcher(const CompletionWatcher&) = delete;
  CompletionWatcher& operator=(const CompletionWatcher&) = delete;

  void add(Op op);
  // Ends every operation still pending now, without waiting for its
  // deadline: one that is done by now finishes as usual; the others are
  // abandoned and their Works fail with `error`. An operation added later
  // fails with `error` at once. Returns once the watcher's thread has
  // stopped. For a group being destroyed.
  void close(std::exception_ptr error);
  // Something may have finished; safe from any thread, never blocks long.
  void notify();
  // A hook for Request::on_done that outlives this watcher safely.
  std::function<void()> notifier() const;

 private:
  struct Signal {
    std::mutex mutex;
    std::condition_variable cv;
    bool told = false;
  };
  // An operation with its deadline, which its Work's first wait sets
  // (from another thread): Clock::time_point::max() until then.
  struct Watched {
    Op op;
    std::shared_ptr<std::atomic<Clock::rep>> deadline;
    Clock::time_point due() const { return Clock::time_point(Clock::duration(deadline->load())); }
  };
  void loop();
  // Tests each of `ops`; finishes those done or expired, keeps the others.
  void sweep(std::vector<Watched>& ops);

  const std::chrono::microseconds poll_;
  std::shared_ptr<Signal> signal_;
  // Finishes `op` as done, else abandons it and fails its Work with `error`.
  static void end(Op& op, const std::exception_ptr& error);

  std::vector<Watched> incoming_;  // guarded by signal_->mutex
  bool stop_ = false;         // likewise
  std::exception_ptr closed_;  // likewise: close()'s error
  std::thread thread_;
};

}  // namespace dtrain
