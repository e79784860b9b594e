#pragma once

// The threads DataParallel runs its replicas on: one persistent thread per
// replica, so a step costs two wake-ups (forward, backward), not thread
// creation.

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dtrain::dp {

class ReplicaPool {
 public:
  // `threads` workers. With single_intra_op_thread each worker runs ATen
  // operations on one intra-op thread (see replica_pool.cpp for how, and why
  // the caller's own setting is left alone).
  ReplicaPool(size_t threads, bool single_intra_op_thread);
  ~ReplicaPool();
  ReplicaPool(const ReplicaPool&) = delete;
  ReplicaPool& operator=(const ReplicaPool&) = delete;

  size_t size() const { return workers_.size(); }

  // Runs tasks[i] on worker i (tasks.size() <= size()) and blocks until all
  // have returned. If any threw, rethrows the exception of the lowest index.
  // Calls from several threads are serialized.
  void run(const std::vector<std::function<void()>>& tasks);

 private:
  void work(size_t index, bool single_intra_op_thread);

  std::mutex run_mutex_;  // one run() at a time
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::vector<std::function<void()>>* tasks_ = nullptr;
  std::vector<std::exception_ptr> errors_;
  uint64_t generation_ = 0;
  size_t pending_ = 0;
  size_t started_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace dtrain::dp
