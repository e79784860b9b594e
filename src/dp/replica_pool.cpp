// ReplicaPool: persistent worker threads for DataParallel's replicas.
//
// Intra-op threads. A replica thread that ran ATen ops with the process's
// intra-op setting would start its own OpenMP team of that size: n replicas
// x t threads on n cores oversubscribes the machine (and OpenMP teams spin).
// With the OpenMP backend the thread count is a per-thread OpenMP setting,
// but at::set_num_threads() also stores it in a process-wide atomic that
// threads created later read when they first initialize. So each worker
// first initializes its own count, then sets it to 1;
// once every worker has done so, the constructor puts the atomic back by
// re-applying the caller's current count on the caller's thread (a no-op for
// the caller itself). The caller's intra-op threads are never changed: it
// only waits while the replicas run, and the work outside the replicas
// (loss, optimizer, gathering) keeps using them.
// The initialization must be libtorch's own: on libtorch 2.x
// at::internal::lazy_init_num_threads() is an inline function whose
// per-thread "done" flag each library keeps for itself, so calling it from
// dtrain left libtorch's flag unset, and libtorch's first parallel call on
// the worker re-applied the process-wide count (2 threads instead of 1, seen
// on 2.11). at::get_num_threads() runs libtorch's lazy initialization.
// With ATen's native thread pool the count is process-wide and fixed once
// parallel work has started, so nothing is changed there: replica threads
// share that one pool.

#include "dp/replica_pool.h"

#include <ATen/Config.h>
#include <ATen/Parallel.h>

#include "common/enforce.h"

namespace dtrain::dp {

ReplicaPool::ReplicaPool(size_t threads, bool single_intra_op_thread) {
  DTRAIN_ENFORCE(threads > 0);
  const int caller_threads = at::get_num_threads();
  workers_.reserve(threads);
  for (size_t i = 0; i < threads; ++i)
    workers_.emplace_back([this, i, single_intra_op_thread] { work(i, single_intra_op_thread); });
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return started_ == workers_.size(); });
#if AT_PARALLEL_OPENMP
  if (single_intra_op_thread) at::set_num_threads(caller_threads);
#else
  (void)caller_threads;
#endif
}

ReplicaPool::~ReplicaPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ReplicaPool::run(const std::vector<std::function<void()>>& tasks) {
  DTRAIN_ENFORCE_LE(tasks.size(), workers_.size());
  std::lock_guard<std::mutex> serial(run_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  tasks_ = &tasks;
  errors_.assign(tasks.size(), nullptr);
  pending_ = tasks.size();
  ++generation_;
  wake_.notify_all();
  done_.wait(lock, [&] { return pending_ == 0; });
  tasks_ = nullptr;
  for (auto& e : errors_)
    if (e) std::rethrow_exception(e);
}

void ReplicaPool::work(size_t index, bool single_intra_op_thread) {
#if AT_PARALLEL_OPENMP
  if (single_intra_op_thread) {
    at::get_num_threads();  // libtorch's lazy per-thread initialization, see above
    at::set_num_threads(1);
  }
#else
  (void)single_intra_op_thread;
#endif
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  ++started_;
  done_.notify_all();
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    // A worker without a task this round may wake only after run() has
    // returned and cleared the list (loaded machine, small batch).
    if (tasks_ == nullptr || index >= tasks_->size()) continue;
    const auto& task = (*tasks_)[index];
    lock.unlock();
    std::exception_ptr error;
    try {
      task();
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    errors_[index] = error;
    if (--pending_ == 0) done_.notify_all();
  }
}

}  // namespace dtrain::dp
