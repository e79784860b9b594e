#pragma once

// Runs tasks one at a time, in submission order, on a thread of its own.
// Each group owns one, which is what makes a group's operations run in issue
// order on every rank while the caller goes on (async_op).
//
// Operations submitted with their Work (submit(work, body)) share one fate,
// under the group's failure policy (core/failure_state.h): the first that
// fails with anything but InvalidArgument or CollectiveMismatch (both raised
// on every rank at the same step: a timeout, a dead peer, a transport
// error) breaks the executor.
// From then on every operation, queued or submitted later, finishes at once
// without running, with broken_group_error naming that first error. So
// after a peer dies the queue empties in one timeout, not one per queued
// operation, and destroying the group does not wait N x timeout.
//
// An operation whose Work is waited for (untimed) while it is next in line
// and nothing runs runs on the waiting thread instead (Work::set_waiter_runs):
// `all_reduce(t)->wait()` then costs no hand-off to the executor's thread and
// no wake-up back, which is most of a small collective's time in shared
// memory. Order is kept: one task at a time, whichever thread runs it.
// An operation queued for its waiter (submit's `announce` false) is left to
// it: the executor's thread, finding it next, gives the waiter kWaiterGrace
// to come before it runs it itself, and a waiter that comes while the
// operation ahead still runs waits for that one, then runs its own. Otherwise a thread that has just run
// one operation takes the next caller's before the caller reaches its wait,
// and every call after it pays a hand-off and a wake-up (measured: 4 KiB
// all_reduce on shared memory 5-7 us instead of 2.3-2.6, for whole runs).

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/failure_state.h"

#include "dtrain/work.h"

namespace dtrain {

class SerialExecutor {
 public:
  // `failures`: the broken state this executor shares with its group's
  // other paths (mpi's point-to-point); its own by default.
  explicit SerialExecutor(std::shared_ptr<FailureState> failures = std::make_shared<FailureState>());
  // Runs what is queued, then joins. Plain tasks each run under their own
  // timeout; operations queued behind a failed one finish at once.
  ~SerialExecutor();
  // What the destructor does, earlier: runs what is queued, then joins.
  // Nothing may be submitted afterwards.
  void shutdown();
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  // Tasks must not throw; they report through their Work.
  void submit(std::function<void()> task);

  // Runs `body` (which throws on failure) in order, then finishes `work`
  // with its outcome; see the header comment for what breaks the executor.
  // The executor is broken before the failed Work is finished, so a caller
  // woken by that failure already sees error().
  // With `waiter_may_run`, an untimed wait may run it (see above). With
  // `announce` false as well, the executor's thread is not woken for it:
  // the caller waits for it at once (Call::blocking), so the wait runs it,
  // or, if something is ahead of it, wakes the executor's thread for that.
  void submit(WorkPtr work, std::function<void()> body, bool waiter_may_run = true,
              bool announce = true);

  // The first error that broke the executor; null while none has.
  std::exception_ptr error() const { return failures_->error(); }

 private:
  struct Task {
    const Work* work;  // null for plain tasks
    std::function<void()> run;
    bool for_waiter = false;  // queued for its waiter, which has not given up on it
  };
  // Shared with the Works' waiter hooks, which may outlive the executor.
  struct Queue {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<Task> tasks;
    bool running = false;  // a task runs, on the executor's thread or a waiter's
    bool stop = false;
    int waiters = 0;  // waiters in run_if_next waiting for the running task to end
    // Runs `work`'s task on the calling thread if it is next and nothing
    // runs; otherwise leaves every queued task to the executor's thread.
    // If `work` is next and queued for its waiter while another task still
    // runs, waits for that one to end first (see the header comment).
    void run_if_next(const Work* work);
    // Wakes the executor's thread for what is queued, and waiters too.
    void notify_idle();
    // Called with `mutex` held, the front task queued for its waiter: waits
    // up to kWaiterGrace for the waiter to take it. True when the executor's
    // thread should take it now (the waiter did not come, or gave it up).
    bool waiter_did_not_come(std::unique_lock<std::mutex>& lock);
  };
  // Long beside the moment from a call's issue to its wait (microseconds);
  // it is paid only when the waiter does not come at all.
  static constexpr std::chrono::milliseconds kWaiterGrace{10};
  void loop();
  std::shared_ptr<FailureState> failures_;
  std::shared_ptr<Queue> queue_ = std::make_shared<Queue>();
  std::thread thread_;
};

}  // namespace dtrain
