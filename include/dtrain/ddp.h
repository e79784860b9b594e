#pragma once

// DistributedDataParallel for libtorch modules (PyTorch's DDP semantics).
//
//   auto net = std::make_shared<Net>();
//   dtrain::DistributedDataParallel ddp(net);          // verifies + broadcasts rank 0's state
//   torch::optim::SGD opt(ddp.parameters(), 0.01);
//   auto loss = criterion(ddp.forward(x), y);
//   loss.backward();                                   // .grad now holds the average over ranks
//   opt.step();
//
// During backward, gradient hooks copy each gradient into its bucket; a
// bucket is all-reduced (asynchronously, on the DDP's communication thread)
// as soon as all its gradients are ready, and buckets launch in the same
// order on every rank. The end of backward waits for the buckets and writes
// the averages into .grad, so nothing extra is needed before step().
//
// The engine (src/ddp/) is non-template; this header only adapts any
// module with a forward() to it.

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtrain/arg.h"
#include "dtrain/no_sync_guard.h"
#include "dtrain/ddp/comm_hooks.h"
#include "dtrain/process_group.h"

namespace dtrain {

struct DDPOptions {
  // Bucket size after the first bucket (which is 1 MiB, as in PyTorch).
  DTRAIN_ARG(double, bucket_cap_mb) = 25.0;
  // .grad of each parameter is a view into its bucket: no copy in or out.
  DTRAIN_ARG(bool, gradient_as_bucket_view) = false;
  // Broadcast buffers (e.g. BatchNorm running stats) from rank 0 before
  // every forward.
  DTRAIN_ARG(bool, broadcast_buffers) = true;
  // Parameters that get no gradient in a backward are treated as ready
  // (with zero gradient) instead of being an error.
  DTRAIN_ARG(bool, find_unused_parameters) = false;
  // The set of used parameters is the same every iteration: learnt in the
  // first one, then unused parameters no longer hold back their buckets.
  DTRAIN_ARG(bool, static_graph) = false;
  // The group to average over; null: the default group.
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, process_group) = nullptr;
  // ZeRO-2: each bucket is reduce-scattered instead of all-reduced, so a
  // rank keeps only its share of the averaged gradients and .grad stays
  // empty; a ZeroRedundancyOptimizer built over this DDP
  // (ZeroRedundancyOptimizer(ddp, factory)) steps on that share. The
  // buckets keep their first layout (no rebuild); no comm hooks, no
  // gradient_as_bucket_view, no join (docs/sharding.md).
  DTRAIN_ARG(bool, shard_gradients) = false;
  // Parameters and buffers, by their fully qualified names in the wrapped
  // module (as its named_parameters() and named_buffers() give them), that DDP leaves
  // alone: not broadcast from rank 0 at the start, not averaged, not
  // synchronized before forwards (PyTorch's
  // _set_params_and_buffers_to_ignore_for_model). For state each rank holds
  // its own of: expert_parallel::ignored_by_data_parallel(model). A name the
  // module does not have is an InvalidArgument.
  DTRAIN_ARG(std::vector<std::string>, params_and_buffers_to_ignore) = {};
};

struct JoinOptions {
  // Divide gradients by the world size even when some ranks have joined
  // (their zeros count); false: divide by the number of ranks still training.
  DTRAIN_ARG(bool, divide_by_initial_world_size) = true;
  // Raise on every rank as soon as one rank runs out of data, instead of
  // shadowing the others.
  DTRAIN_ARG(bool, throw_on_early_termination) = false;
};

// What the last synchronized iteration cost.
struct DDPStats {
  int64_t iteration = 0;          // synchronized backward passes so far
  double backward_ms = 0;         // first gradient hook to the end of backward
  double communication_ms = 0;    // sum over buckets of launch-to-done time
  double exposed_ms = 0;          // time the end of backward waited for buckets
  double hidden_fraction = 0;     // 1 - exposed / communication (0 when no communication)
  std::vector<int64_t> bucket_bytes;
  bool buckets_rebuilt = false;
};

namespace ddp {
struct ShardedGradients;  // src/ddp/sharded_gradients.h
}

namespace detail {

// The non-template engine behind DistributedDataParallel.
class DDPCore {
 public:
  DDPCore(torch::nn::Module& wrapper, const DDPOptions& options);
  ~DDPCore();
  DDPCore(const DDPCore&) = delete;
  DDPCore& operator=(const DDPCore&) = delete;

  void pre_forward();
  void post_forward();
  void set_sync(bool enabled);
  bool sync_enabled() const;
  // Pipelining: the next backward is synchronized although the forward
  // that built its graph ran without synchronization (a pipeline runs its
  // microbatches' forwards before the last one's backward); turns
  // synchronization on. That backward averages everything accumulated.
  void sync_next_backward();
  void register_comm_hook(CommHook hook);
  DDPStats stats() const;
  void join(const JoinOptions& options, const std::function<void()>& body);
  ProcessGroup& group() const;
  std::shared_ptr<ProcessGroup> shared_group() const;
  // The parameters DDP synchronizes (those requiring grad), in module order.
  const std::vector<torch::Tensor>& parameters() const;
  // Set under DDPOptions::shard_gradients, else null.
  std::shared_ptr<ddp::ShardedGradients> sharded_gradients() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace detail

// Restores synchronization when it goes out of scope.
using NoSyncGuard = ScopedNoSync<detail::DDPCore>;

template <typename ModuleType>
class DistributedDataParallel : public torch::nn::Module {
 public:
  explicit DistributedDataParallel(std::shared_ptr<ModuleType> module,
                                   const DDPOptions& options = DDPOptions())
      : module_(register_module("module", std::move(module))),
        core_(std::make_unique<detail::DDPCore>(*this, options)) {}

  template <typename Impl>
  explicit DistributedDataParallel(torch::nn::ModuleHolder<Impl> holder,
                                   const DDPOptions& options = DDPOptions())
      : DistributedDataParallel(holder.ptr(), options) {}

  // Runs the wrapped module's forward; the next backward averages gradients.
  template <typename... Args>
  auto forward(Args&&... args) {
    core_->pre_forward();
    auto out = module_->forward(std::forward<Args>(args)...);
    core_->post_forward();
    return out;
  }

  // Under the guard, backward accumulates .grad locally; the first
  // synchronized backward after it averages the accumulated gradients.
  NoSyncGuard no_sync() { return NoSyncGuard(*core_); }

  // Runs `body` (the training loop) so that ranks with fewer batches than
  // others do not hang: once a rank's body returns, it shadows the other
  // ranks' collectives until every rank is done; then all ranks take the
  // parameters of the rank that trained longest.
  void join(const std::function<void()>& body, const JoinOptions& options = JoinOptions()) {
    core_->join(options, body);
  }

  void register_comm_hook(CommHook hook) { core_->register_comm_hook(std::move(hook)); }
  DDPStats stats() const { return core_->stats(); }
  const std::shared_ptr<ModuleType>& module() const { return module_; }
  ProcessGroup& process_group() const { return core_->group(); }
  // The engine (for ZeroRedundancyOptimizer(ddp, factory)).
  detail::DDPCore& engine() const { return *core_; }

 private:
  std::shared_ptr<ModuleType> module_;
  std::unique_ptr<detail::DDPCore> core_;
};

template <typename ModuleType>
DistributedDataParallel(std::shared_ptr<ModuleType>) -> DistributedDataParallel<ModuleType>;
template <typename ModuleType>
DistributedDataParallel(std::shared_ptr<ModuleType>, const DDPOptions&)
    -> DistributedDataParallel<ModuleType>;
template <typename Impl>
DistributedDataParallel(torch::nn::ModuleHolder<Impl>) -> DistributedDataParallel<Impl>;
template <typename Impl>
DistributedDataParallel(torch::nn::ModuleHolder<Impl>, const DDPOptions&)
    -> DistributedDataParallel<Impl>;

}  // namespace dtrain
