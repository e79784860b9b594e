#include "core/completion_watcher.h"

#include <algorithm>

namespace dtrain {

CompletionWatcher::CompletionWatcher(std::chrono::microseconds poll)
    : poll_(poll), signal_(std::make_shared<Signal>()), thread_([this] { loop(); }) {}

CompletionWatcher::~CompletionWatcher() {
  {
    std::lock_guard<std::mutex> lock(signal_->mutex);
    stop_ = true;
  }
  signal_->cv.notify_all();
  if (thread_.joinable()) thread_.join();
}

void CompletionWatcher::add(Op op) {
  std::exception_ptr closed;
  {
    std::lock_guard<std::mutex> lock(signal_->mutex);
    closed = closed_;
    if (!closed) {
      incoming_.push_back(std::move(op));
      signal_->told = true;
    }
  }
  if (closed) {
    end(op, closed);
    return;
  }
  signal_->cv.notify_all();
}

void CompletionWatcher::close(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(signal_->mutex);
    if (closed_) return;
    closed_ = error;
    stop_ = true;
    signal_->told = true;
  }
  signal_->cv.notify_all();
  thread_.join();
}

void CompletionWatcher::end(Op& op, const std::exception_ptr& error) {
  std::exception_ptr result = error;
  try {
    if (op.test()) result = nullptr;
    else if (op.abandon) op.abandon();
  } catch (...) {
    result = std::current_exception();
  }
  op.work->finish(result);
}

void CompletionWatcher::notify() {
  {
    std::lock_guard<std::mutex> lock(signal_->mutex);
    signal_->told = true;
  }
  signal_->cv.notify_all();
}

std::function<void()> CompletionWatcher::notifier() const {
  return [signal = signal_] {
    {
      std::lock_guard<std::mutex> lock(signal->mutex);
      signal->told = true;
    }
    signal->cv.notify_all();
  };
}

void CompletionWatcher::loop() {
  std::vector<Op> ops;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(signal_->mutex);
      auto wake = Clock::time_point::max();
      for (const auto& op : ops) wake = std::min(wake, op.deadline);
      if (poll_.count() > 0 && !ops.empty()) wake = std::min(wake, Clock::now() + poll_);
      const auto ready = [&] { return signal_->told || (stop_ && ops.empty()); };
      if (wake == Clock::time_point::max()) signal_->cv.wait(lock, ready);
      else signal_->cv.wait_until(lock, wake, ready);
      if (closed_) {
        for (auto& op : incoming_) ops.push_back(std::move(op));
        incoming_.clear();
        const auto error = closed_;
        lock.unlock();
        for (auto& op : ops) end(op, error);
        return;
      }
      if (stop_ && ops.empty() && incoming_.empty()) return;
      signal_->told = false;
      for (auto& op : incoming_) ops.push_back(std::move(op));
      incoming_.clear();
    }
    sweep(ops);
  }
}

void CompletionWatcher::sweep(std::vector<Op>& ops) {
  const auto now = Clock::now();
  std::vector<Op> kept;
  kept.reserve(ops.size());
  for (auto& op : ops) {
    std::exception_ptr error;
    try {
      if (!op.test()) {
        if (now < op.deadline) {
          kept.push_back(std::move(op));
          continue;
        }
        op.expire();
      }
    } catch (...) {
      error = std::current_exception();
    }
    op.work->finish(error);
  }
  ops.swap(kept);
}

}  // namespace dtrain
