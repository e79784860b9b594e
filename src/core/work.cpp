#include "dtrain/work.h"

#include "common/enforce.h"

namespace dtrain {

// Callers see the result once the on_finish callbacks have run (woken_);
// the callbacks themselves may already ask for source_rank() (done_).
bool Work::is_completed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return woken_;
}

int Work::source_rank() const {
  std::lock_guard<std::mutex> lock(mutex_);
  DTRAIN_CHECK_ARG(done_ && !error_ && source_rank_ >= 0, "source_rank: ", description_,
                   " is not a receive that has completed successfully");
  return source_rank_;
}

void Work::set_source_rank(int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  source_rank_ = rank;
}

bool Work::is_success() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return woken_ && !error_;
}

std::exception_ptr Work::exception() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return woken_ ? error_ : nullptr;
}

bool Work::on_device() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<bool>(device_wait_);
}

void Work::set_device_wait(std::function<void()> stream_wait) {
  std::lock_guard<std::mutex> lock(mutex_);
  device_wait_ = std::move(stream_wait);
}

void Work::on_first_wait(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!waited_) {
      first_wait_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

void Work::note_waiting() {
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (waited_) return;
    waited_ = true;
    hooks.swap(first_wait_);
  }
  for (auto& fn : hooks) fn();
}

void Work::wait(std::chrono::milliseconds timeout) {
  note_waiting();
  std::function<void()> device_wait;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (woken_ && error_) std::rethrow_exception(error_);
    device_wait = device_wait_;
  }
  if (!device_wait) return synchronize(timeout);
  device_wait();
}

void Work::set_waiter_runs(std::function<void()> run) {
  std::lock_guard<std::mutex> lock(mutex_);
  waiter_runs_ = std::move(run);
}

void Work::synchronize(std::chrono::milliseconds timeout) {
  note_waiting();
  std::unique_lock<std::mutex> lock(mutex_);
  // An untimed wait may run the operation here: a timed one must return
  // at its timeout, which an operation running on this thread cannot.
  if (timeout < std::chrono::milliseconds::zero() && waiter_runs_ && !woken_) {
    auto run = std::move(waiter_runs_);
    waiter_runs_ = nullptr;
    lock.unlock();
    run();
    lock.lock();
  }
  if (timeout < std::chrono::milliseconds::zero()) {
    done_cv_.wait(lock, [&] { return woken_; });
  } else if (!done_cv_.wait_for(lock, timeout, [&] { return woken_; })) {
    throw TimeoutError(detail::cat(description_.empty() ? "operation" : description_,
                                   " did not complete within ", timeout.count(),
                                   " ms (Work::wait timeout)"));
  }
  if (error_) std::rethrow_exception(error_);
}

// Three steps: the on_success callbacks (which may still turn success into
// failure), the result set (done_), the on_finish callbacks, and only then
// the waiters woken. So a caller that lets the failure end its program
// does so after the callbacks — the flight recorder's dump — are done.
void Work::finish(std::exception_ptr error) {
  std::vector<std::function<void()>> then;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    DTRAIN_ENFORCE(!finishing_);
    finishing_ = true;
    then.swap(then_);
  }
  for (auto& fn : then) {
    if (error) break;
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
  }
  std::vector<std::function<void(const std::exception_ptr&)>> finished;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    error_ = error;
    finished.swap(finished_);
    waiter_runs_ = nullptr;
  }
  done_cv_.notify_all();  // on_success calls waiting for the result
  for (auto& fn : finished) fn(error);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    woken_ = true;
  }
  done_cv_.notify_all();
}

void Work::on_finish(std::function<void(const std::exception_ptr&)> fn) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!done_) {
    finished_.push_back(std::move(fn));
    return;
  }
  auto error = error_;
  lock.unlock();
  fn(error);
}

void Work::on_success(std::function<void()> fn) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!finishing_) {
    then_.push_back(std::move(fn));
    return;
  }
  // Finishing on another thread right now: let it set the result, then run
  // here. As on the finishing thread, an exception fails the work.
  done_cv_.wait(lock, [&] { return done_; });
  if (error_) return;
  lock.unlock();
  try {
    fn();
  } catch (...) {
    lock.lock();
    error_ = std::current_exception();
  }
}

std::shared_ptr<Work> Work::completed(std::string description) {
  auto work = std::make_shared<Work>(std::move(description));
  work->finish();
  return work;
}

}  // namespace dtrain
