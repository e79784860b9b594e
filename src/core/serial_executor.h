#pragma once

// Runs tasks one at a time, in submission order, on a thread of its own.
// Each group owns one, which is what makes a group's operations run in issue
// order on every rank while the caller goes on (async_op).

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace dtrain {

class SerialExecutor {
 public:
  SerialExecutor();
  // Runs what is queued (every task is bounded by its own timeout), then joins.
  ~SerialExecutor();
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  // Tasks must not throw; they report through their Work.
  void submit(std::function<void()> task);

 private:
  void loop();
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dtrain
