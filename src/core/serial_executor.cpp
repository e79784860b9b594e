#include "core/serial_executor.h"

namespace dtrain {

SerialExecutor::SerialExecutor(std::shared_ptr<FailureState> failures)
    : failures_(std::move(failures)), thread_([this] { loop(); }) {}

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
  submit([this, work = std::move(work), body = std::move(body)] { failures_->run(*work, body); });
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
