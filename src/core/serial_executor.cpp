#include "core/serial_executor.h"

#include "core/broken_group.h"
#include "dtrain/errors.h"

namespace dtrain {

SerialExecutor::SerialExecutor() : thread_([this] { loop(); }) {}

SerialExecutor::~SerialExecutor() { shutdown(); }

void SerialExecutor::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void SerialExecutor::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void SerialExecutor::submit(WorkPtr work, std::function<void()> body) {
  submit([this, work = std::move(work), body = std::move(body)] { run_op(*work, body); });
}

std::exception_ptr SerialExecutor::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

// An InvalidArgument is raised before anything is sent, and a
// CollectiveMismatch that reaches here was seen by every rank at the same
// step (shm's descriptor check, the fingerprint check): the ranks are still
// in step and the executor goes on. Anything else breaks it. (tcp's
// transport-level mismatches also fail its transport, which breaks the group.)
void SerialExecutor::run_op(Work& work, const std::function<void()>& body) {
  if (auto first = error()) {
    work.finish(broken_group_error(work.description(), first));
    return;
  }
  std::exception_ptr failure;
  try {
    body();
  } catch (const InvalidArgument&) {
    failure = std::current_exception();
  } catch (const CollectiveMismatch&) {
    failure = std::current_exception();
  } catch (...) {
    failure = std::current_exception();
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = failure;
  }
  work.finish(failure);
}

void SerialExecutor::loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stop_ and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace dtrain
