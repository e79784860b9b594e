#pragma once

// The gradient reducer behind DistributedDataParallel.
//
// Owns the buckets (flat buffers with one view per parameter), the autograd
// hooks that fire once a parameter's .grad has been accumulated, and the
// communication thread that runs the comm hook on each bucket. Coalescing
// (which gradient goes where) stays here; communication is the comm hook's.
//
// One synchronized backward, in order:
//   prepare_for_backward()   after a forward with sync enabled
//   on_grad_ready(i)         each hook: copy .grad into its bucket slot; a
//                            full bucket is launched once all earlier ones
//                            have been (same launch order on every rank)
//   finalize()               queued to run when backward ends: treat
//                            missing gradients (unused parameters or an
//                            error), wait for the buckets, write averages to
//                            .grad, rebuild buckets after the first iteration

#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/torch_compat.h"
#include "core/serial_executor.h"
#include "ddp/sharded_gradients.h"
#include "dtrain/ddp.h"

namespace dtrain::ddp {

struct ReducerOptions {
  size_t first_bucket_bytes = 1 << 20;
  size_t bucket_bytes = 25 << 20;
  bool gradient_as_bucket_view = false;
  bool find_unused_parameters = false;
  bool static_graph = false;
  // ZeRO-2: buckets are reduce-scattered into ShardedGradients::grad
  // instead of all-reduced; .grad stays empty (sharded_gradients.h).
  bool shard_gradients = false;
};

class Reducer {
 public:
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names, ProcessGroup& group,
          ReducerOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  void set_comm_hook(CommHook hook);
  // What the bucket sums are divided by (world size, or ranks still training).
  void set_divisor(double divisor) { divisor_ = divisor; }
  void prepare_for_backward();
  // A joined rank's stand-in for a backward: zero buckets, same collectives.
  void shadow_backward();
  DDPStats stats() const;
  // Set with ReducerOptions::shard_gradients, else null.
  const std::shared_ptr<ShardedGradients>& sharded_gradients() const { return sharded_; }

  // Called by the autograd hook of parameter `index`.
  void on_grad_ready(size_t index);

 private:
  struct Bucket;
  struct Slot {
    size_t bucket;
    size_t position;  // index into the bucket's views
  };

  void build_buckets(const std::vector<size_t>& order);
  void make_views(Bucket& bucket);
  // shard_gradients (reducer_sharded.cpp)
  void describe_shards();
  void materialize(Bucket& bucket);
  void launch_sharded(size_t index);
  void release_finished_buckets();
  void settle_sharded();
  void release_sharded_buffers();
  static void release_buffer(Bucket& bucket);
  void mark_ready(size_t index, bool has_grad);
  void launch_ready_buckets();
  void finalize(bool shadow);
  void draw_timeline(std::chrono::steady_clock::time_point backward_end,
                     std::chrono::steady_clock::time_point wait_start,
                     std::chrono::steady_clock::time_point wait_end);
  void wait_for_buckets();
  std::vector<bool> globally_used();
  void write_back(const std::vector<bool>& used);
  void rebuild_from_observed_order();
  void reset_iteration();
  void abandon_unfinished_backward();
  [[noreturn]] void fail_missing_gradients(const std::vector<size_t>& missing);

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  ProcessGroup& group_;
  ReducerOptions options_;
  CommHook hook_;
  bool custom_hook_ = false;  // false: the default all-reduce, issued inline
  // World size 1 with the default hook: gradients stay where autograd put
  // them (nothing to average).
  bool solo() const { return group_.size() == 1 && !custom_hook_ && !sharded_; }
  double divisor_;

  std::vector<compat::NodePtr> accumulators_;
  std::vector<uintptr_t> hook_keys_;

  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::shared_ptr<ShardedGradients> sharded_;
  std::vector<Slot> slot_of_;

  mutable std::mutex mutex_;  // hooks may run on autograd worker threads
  bool expect_backward_ = false;
  bool backward_started_ = false;
  std::vector<bool> ready_;
  std::vector<bool> locally_used_;
  size_t next_launch_ = 0;
  std::vector<size_t> observed_order_;
  std::vector<bool> static_unused_;  // learnt in the first iteration (static_graph)
  bool rebuilt_ = false;
  int64_t iteration_ = 0;
  std::chrono::steady_clock::time_point backward_start_;
  DDPStats stats_;

  SerialExecutor comm_;  // last: destroyed first, after draining
};

}  // namespace dtrain::ddp
