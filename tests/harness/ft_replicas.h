#pragma once

// What the fault-tolerance tests (ft_test) share: replicas as threads.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/dtrain.h"

namespace dtrain::testing {

inline at::Tensor flat_parameters(torch::nn::Module& m) {
  std::vector<at::Tensor> ps;
  for (auto& p : m.parameters()) ps.push_back(p.detach().flatten());
  return torch::cat(ps).clone();
}

// The replicas' first lives start training together, once every manager
// has registered with the lighthouse (its heartbeat thread does so at
// once): no replica forms a first quorum alone.
class StartLine {
 public:
  explicit StartLine(int n) : n_(n) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (++arrived_ == n_) {
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      lock.lock();
      released_ = true;
      cv_.notify_all();
    }
    cv_.wait(lock, [&] { return released_; });
  }

 private:
  int n_, arrived_ = 0;
  bool released_ = false;
  std::mutex mutex_;
  std::condition_variable cv_;
};

// Threads, each its own body; the first exception of each fails the test.
inline void run_threads(int n, const std::function<void(int)>& body) {
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t)
    threads.emplace_back([&, t] {
      try {
        body(t);
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int t = 0; t < n; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
}

// Two replicas ("a", "b") of two thread ranks each around `lighthouse`:
// body(t, the replica's group, its ranks' ManagerOptions) on thread
// t = 2 x replica + rank. min_replicas 2; init_sync off (the replicas start
// from one seed: no step-0 heal, every gradient counts).
inline void run_two_replicas_of_two(
    const ft::Lighthouse& lighthouse,
    const std::function<void(int, std::shared_ptr<ProcessGroup>, ft::ManagerOptions)>& body) {
  using namespace std::chrono_literals;
  std::vector<std::shared_ptr<Store>> stores{std::make_shared<HashStore>(30s), std::make_shared<HashStore>(30s)};
  run_threads(4, [&](int t) {
    const int replica = t / 2, local = t % 2;
    auto inner = create_process_group("tcp", stores[replica], local, 2, GroupOptions().name("replica").timeout(30s));
    body(t, inner,
         ft::ManagerOptions()
             .lighthouse(lighthouse.address())
             .replica_id(replica == 0 ? "a" : "b")
             .group(inner)
             .store(stores[replica])
             .min_replicas(2)
             .init_sync(false)
             .timeout(30s));
  });
}

// What each replica's parameters were after each step it committed.
struct CommitLog {
  std::mutex mutex;
  std::map<int64_t, std::map<std::string, at::Tensor>> after;
  void record(int64_t step, const std::string& replica, const at::Tensor& params) {
    std::lock_guard<std::mutex> lock(mutex);
    after[step][replica] = params;
  }
};

}  // namespace dtrain::testing
