#include "core/serial_executor.h"

namespace dtrain {

SerialExecutor::SerialExecutor(std::shared_ptr<FailureState> failures)
    : failures_(std::move(failures)), thread_([this] { loop(); }) {}

SerialExecutor::~SerialExecutor() { shutdown(); }

void SerialExecutor::shutdown() {
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    queue_->stop = true;
  }
  queue_->cv.notify_all();
  if (thread_.joinable()) thread_.join();
}

void SerialExecutor::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    queue_->tasks.push_back(Task{nullptr, std::move(task)});
  }
  queue_->cv.notify_one();
}

void SerialExecutor::submit(WorkPtr work, std::function<void()> body, bool waiter_may_run,
                            bool announce) {
  if (waiter_may_run)
    work->set_waiter_runs([queue = std::weak_ptr<Queue>(queue_), w = work.get()] {
      if (auto q = queue.lock()) q->run_if_next(w);
    });
  const Work* key = work.get();
  auto run = [this, work = std::move(work), body = std::move(body)] {
    failures_->run(*work, body);
  };
  const bool for_waiter = waiter_may_run && !announce;
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    queue_->tasks.push_back(Task{key, std::move(run), for_waiter});
  }
  if (!for_waiter) queue_->cv.notify_one();
}

void SerialExecutor::Queue::run_if_next(const Work* work) {
  std::function<void()> task;
  {
    std::unique_lock<std::mutex> lock(mutex);
    if (running && !tasks.empty() && tasks.front().work == work && tasks.front().for_waiter) {
      // Next, and the one ahead is still running (often only finishing:
      // its Work is complete, its thread not yet done): wait for it and run
      // this one here. Handing it to the executor's thread instead costs a
      // hand-off and a wake-up back, and the call after it the same.
      ++waiters;
      cv.wait(lock, [&] { return !running || stop || tasks.empty() || tasks.front().work != work; });
      --waiters;
    }
    if (running || tasks.empty() || tasks.front().work != work) {
      // Something else is next or runs: the executor's thread runs what is
      // ahead, and then this waiter's task, without waiting for waiters.
      for (auto& t : tasks) t.for_waiter = false;
      const bool tell = !running && !tasks.empty();
      lock.unlock();
      if (tell) cv.notify_one();
      return;
    }
    task = std::move(tasks.front().run);
    tasks.pop_front();
    running = true;
  }
  // Tasks do not throw (they report through their Work); the executor's
  // thread is told even if one did, when there is something for it: what
  // was queued meanwhile, or stop. Waking it for nothing would cost the
  // next small collective a context switch.
  struct Done {
    Queue& q;
    ~Done() {
      bool tell;
      {
        std::lock_guard<std::mutex> lock(q.mutex);
        q.running = false;
        tell = q.stop || !q.tasks.empty();
      }
      if (tell) q.notify_idle();
    }
  } done{*this};
  task();
}

void SerialExecutor::Queue::notify_idle() {
  bool all;
  {
    std::lock_guard<std::mutex> lock(mutex);
    all = waiters > 0;
  }
  if (all) cv.notify_all();
  else cv.notify_one();
}

bool SerialExecutor::Queue::waiter_did_not_come(std::unique_lock<std::mutex>& lock) {
  const Work* front = tasks.front().work;
  const bool moved = cv.wait_for(lock, kWaiterGrace, [&] {
    return stop || running || tasks.empty() || tasks.front().work != front ||
           !tasks.front().for_waiter;
  });
  if (!moved) return true;
  // Given up by its waiter (it found something ahead), or stopping: take it
  // now. Taken by the waiter, or another is next: look again.
  return !running && !tasks.empty() && tasks.front().work == front;
}

// Ends once stopped with nothing queued and nothing running (a waiter's
// task included: the group's state must outlive it).
void SerialExecutor::loop() {
  auto& q = *queue_;
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(q.mutex);
      q.cv.wait(lock, [&] { return !q.running && (q.stop || !q.tasks.empty()); });
      if (q.tasks.empty()) return;  // stopped and drained
      if (q.tasks.front().for_waiter && !q.stop && !q.waiter_did_not_come(lock)) continue;
      task = std::move(q.tasks.front().run);
      q.tasks.pop_front();
      q.running = true;
    }
    task();
    bool tell;
    {
      std::lock_guard<std::mutex> lock(q.mutex);
      q.running = false;
      tell = q.waiters > 0;
    }
    if (tell) q.cv.notify_all();
  }
}

}  // namespace dtrain
