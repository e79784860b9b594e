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
  Watched w;
  w.deadline = std::make_shared<std::atomic<Clock::rep>>(Clock::time_point::max().time_since_epoch().count());
  // The first wait arms the deadline (saturating: a timeout of hours or
  // more must not wrap around) and wakes the thread to take it into account.
  op.work->on_first_wait([deadline = w.deadline, timeout = op.timeout, notify = notifier()] {
    const auto now = Clock::now();
    const auto due = timeout >= Clock::time_point::max() - now ? Clock::time_point::max() : now + timeout;
    deadline->store(due.time_since_epoch().count());
    notify();
  });
  w.op = std::move(op);
  std::exception_ptr closed;
  {
    std::lock_guard<std::mutex> lock(signal_->mutex);
    closed = closed_;
    if (!closed) {
      incoming_.push_back(std::move(w));
      signal_->told = true;
    }
  }
  if (closed) {
    end(w.op, closed);
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
  std::vector<Watched> ops;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(signal_->mutex);
      auto wake = Clock::time_point::max();
      for (const auto& w : ops) wake = std::min(wake, w.due());
      if (poll_.count() > 0 && !ops.empty()) wake = std::min(wake, Clock::now() + poll_);
      const auto ready = [&] { return signal_->told || (stop_ && ops.empty()); };
      if (wake == Clock::time_point::max()) signal_->cv.wait(lock, ready);
      else signal_->cv.wait_until(lock, wake, ready);
      if (closed_) {
        for (auto& w : incoming_) ops.push_back(std::move(w));
        incoming_.clear();
        const auto error = closed_;
        lock.unlock();
        for (auto& w : ops) end(w.op, error);
        return;
      }
      if (stop_ && ops.empty() && incoming_.empty()) return;
      signal_->told = false;
      for (auto& w : incoming_) ops.push_back(std::move(w));
      incoming_.clear();
    }
    sweep(ops);
  }
}

void CompletionWatcher::sweep(std::vector<Watched>& ops) {
  const auto now = Clock::now();
  std::vector<Watched> kept;
  kept.reserve(ops.size());
  for (auto& w : ops) {
    std::exception_ptr error;
    try {
      if (!w.op.test()) {
        const auto due = w.due();
        if (now < due) {
          kept.push_back(std::move(w));
          continue;
        }
        w.op.expire(due);
      }
    } catch (...) {
      error = std::current_exception();
    }
    w.op.work->finish(error);
  }
  ops.swap(kept);
}

}  // namespace dtrain
