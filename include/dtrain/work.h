#pragma once

// Work: the handle of one asynchronous operation.
//
// Contract (the same for every backend):
//  - is_completed() is true once the operation has finished, successfully or
//    not; it never blocks.
//  - wait(timeout) blocks until the operation finishes. It rethrows the
//    operation's failure (the same dtrain::Error subtype every time it is
//    called), or throws dtrain::TimeoutError if the operation is still
//    running when `timeout` passes. With no argument it waits without a
//    limit of its own; the operation itself always ends, because every
//    backend runs it under the group's timeout, which bounds a stall, not
//    the length of healthy work: a collective's counts from when it starts
//    to run, once the collectives issued before it on its group have
//    finished (so a long queue of healthy collectives never times out, and
//    one behind a stalled collective fails as soon as that one times out);
//    a send's or recv's from when it is first waited on (a pipeline posts
//    its receives ahead). On nccl, as in PyTorch's ProcessGroupNCCL, a
//    collective's counts from when it was issued to its stream. A send or recv that nobody waits on never times out; it ends
//    when its message has gone or arrived, or when its group is destroyed
//    or breaks. It returns (or rethrows)
//    only after the work's on_finish callbacks have run, so a failure that
//    escapes the program finds the flight recorder's dump already written.
//  - exception() is null until the operation fails, then holds the failure.
//  - After wait() returns normally, output tensors hold their results.
//  - Collectives of one group run in the order they were issued, on every
//    rank. Each send and recv completes on its own, as soon as its message
//    has gone or arrived, whatever was posted before it. Work handles may
//    be waited on in any order and from any thread.
//
// Device work (CUDA tensors on the nccl backend; PyTorch's ProcessGroupNCCL
// semantics):
//  - The operation is ordered after everything already queued on the
//    issuing thread's current CUDA stream: tensors may be produced by
//    kernels that have not run yet.
//  - wait() does not block the host: it makes the calling thread's current
//    CUDA stream wait for the operation's end, so kernels queued after it
//    see the results. It throws at once if the work has already failed.
//  - synchronize() blocks the host until the operation has finished on the
//    device (or failed), like wait() on CPU work; with a timeout it throws
//    TimeoutError if the work is still running then.
//  - The backend keeps the tensors alive until the operation has finished
//    on the device, also when every handle is dropped; failures (a timeout
//    of the group, an NCCL error) are found by the backend's watchdog, which
//    finishes the work with the error and breaks the group.
// Completion is implemented once, here; backends call finish().

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dtrain {

class Work {
 public:
  static constexpr std::chrono::milliseconds kNoTimeout{-1};

  explicit Work(std::string description = "") : description_(std::move(description)) {}
  virtual ~Work() = default;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  bool is_completed() const;
  bool is_success() const;
  std::exception_ptr exception() const;
  void wait(std::chrono::milliseconds timeout = kNoTimeout);
  // Blocks the host until the work has finished (see above); on CPU work the
  // same as wait().
  void synchronize(std::chrono::milliseconds timeout = kNoTimeout);
  // True for device work, whose wait() orders the caller's stream instead
  // of blocking.
  bool on_device() const;

  // For backends: makes this device work. `stream_wait` is what wait() runs
  // (it makes the calling thread's current stream wait for the work's end);
  // call before the work is handed out.
  void set_device_wait(std::function<void()> stream_wait);

  // For backends: runs `fn` once, on the thread that first waits on this
  // work (wait() or synchronize(), or note_waiting()), before it blocks; at
  // once if that has happened already. Point-to-point operations start
  // their timeout there.
  void on_first_wait(std::function<void()> fn);
  // For backends whose Work stands for another's: counts as a first wait
  // (runs the on_first_wait callbacks), without blocking.
  void note_waiting();

  // For backends: `run` lets the thread that waits for this work without a
  // timeout (wait() or synchronize()) run the queued operation itself
  // instead of handing it to a thread and being woken back: it runs the
  // operation when nothing runs before it, and does nothing otherwise (the
  // waiter then blocks as usual). Called at most once; set before the work
  // is handed out.
  void set_waiter_runs(std::function<void()> run);

  // What the operation is, e.g. "all_reduce #12 on group 'default'".
  const std::string& description() const { return description_; }

  // The rank (in its group) a receive got its message from: for a receive
  // from kAnySource, the rank it was matched with. Throws InvalidArgument
  // for other work, or before the receive has succeeded.
  int source_rank() const;
  // For backends: records the source of a receive, before finish().
  void set_source_rank(int rank);

  // For backends: marks the work finished (with a failure when `error` is
  // set) and wakes every waiter. Must be called exactly once.
  void finish(std::exception_ptr error = nullptr);

  // Runs `fn` when the work succeeds, before any waiter is woken, on the
  // thread that finishes the work. An exception from `fn` becomes the
  // work's failure, and the callbacks registered after it do not run. Used
  // to copy results out of staging buffers.
  // On a work that has already succeeded, `fn` runs at once on the calling
  // thread, and the same holds: an exception from it makes the work failed
  // (wait() rethrows it, is_success() is false, exception() holds it); it
  // does not propagate out of on_success. On a work that has failed, `fn`
  // never runs.
  void on_success(std::function<void()> fn);

  // Runs `fn(error)` once the work has finished, successfully (null error)
  // or not, on the thread that finished it (at once if it already has).
  // These callbacks run before wait() returns or rethrows, so what they do
  // (the flight recorder's dump after a failure) is done before the caller
  // sees the result (is_completed() turns true after them too; source_rank()
  // already answers inside them). `fn` must not throw and must not wait on
  // this work.
  void on_finish(std::function<void(const std::exception_ptr&)> fn);

  // A Work that is already completed successfully.
  static std::shared_ptr<Work> completed(std::string description = "");

 private:
  const std::string description_;
  mutable std::mutex mutex_;
  std::condition_variable done_cv_;
  bool finishing_ = false;  // finish() has begun: on_success callbacks are running
  bool done_ = false;       // the result is set; on_finish callbacks may be running
  bool woken_ = false;      // the on_finish callbacks have run: waiters may return
  int source_rank_ = -1;
  std::exception_ptr error_;
  std::vector<std::function<void()>> then_;
  std::vector<std::function<void(const std::exception_ptr&)>> finished_;
  std::function<void()> device_wait_;
  bool waited_ = false;  // the on_first_wait callbacks have run (or are running)
  std::vector<std::function<void()>> first_wait_;
  std::function<void()> waiter_runs_;
};

using WorkPtr = std::shared_ptr<Work>;

}  // namespace dtrain
