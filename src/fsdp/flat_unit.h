#pragma once

// One FSDP unit: the parameters of a module (minus those of units nested
// in it) as one flat buffer sharded across the group. The rank's shard is
// the tensor the optimizer steps on; the full buffer's storage exists only
// between gather() and reshard(), and the module's parameters are views of
// it (their TensorImpls never change, so autograd's saved tensors see the
// memory come back when the unit is gathered again for backward).

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/torch_compat.h"
#include "dtrain/fsdp.h"
#include "dtrain/process_group.h"

namespace dtrain::fsdp {

class FlatUnit {
 public:
  // Collective over `group`: broadcasts rank 0's values of `params`, keeps
  // this rank's shard and frees the full storage.
  FlatUnit(std::string name, std::vector<at::Tensor> params, std::vector<std::string> names,
           ProcessGroup& group);
  // Once, before use: the compute and reduce dtypes, and `on_grad`, called
  // with the parameter's index each time autograd accumulates its gradient.
  void configure(const MixedPrecision& precision, std::function<void(FlatUnit&, size_t)> on_grad);
  // The unit's path and its parameters' names in the whole model (a unit
  // sharded at construction knew only its own).
  void rename(std::string name, std::vector<std::string> names);
  ProcessGroup& group() const { return group_; }
  // HSDP. Collective over `replicas` (the ranks holding the same shard in
  // other replicas): broadcasts replica 0's shard, and from now on each
  // reduce-scattered gradient is also all-reduced over them.
  void replicate_over(ProcessGroup& replicas);
  // HSDP with the average across replicas done by `average`
  // (FSDPOptions::replicate_average): each reduce-scattered gradient,
  // averaged over the group, is handed to it.
  void replicate_with(std::function<WorkPtr(at::Tensor)> average);
  ~FlatUnit();
  FlatUnit(const FlatUnit&) = delete;
  FlatUnit& operator=(const FlatUnit&) = delete;

  const std::string& name() const { return name_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  const std::vector<std::string>& param_names() const { return names_; }
  const std::vector<int64_t>& param_offsets() const { return offsets_; }  // in the flat parameters
  const at::Tensor& shard() const { return shard_; }
  bool trainable() const { return trainable_; }
  int64_t numel() const { return numel_; }
  int64_t shard_offset() const { return group_.rank() * slice_; }

  // Full parameters. start_gather() allocates the storage and launches the
  // all-gather (nothing if already gathered); wait_gathered() also waits.
  void start_gather();
  void wait_gathered();
  bool gathered() const { return allocated_; }
  int64_t full_bytes() const { return static_cast<int64_t>(full_bytes_); }
  // Frees the full storage (after any all-gather in flight); with
  // writeback, first copies this rank's slice of the full values into the
  // shard.
  void reshard(bool writeback = false);

  // Gradients. Counts one accumulated gradient; true once every trainable
  // parameter has one in this backward.
  bool count_grad(size_t index);
  bool reduced() const { return reduced_; }
  // Moves the parameters' gradients into a flat buffer (zeros for those
  // without one) and frees them; with sync, launches the reduce-scatter,
  // else adds the buffer to the gradients kept for the next sync.
  void reduce(bool sync);
  // Waits for the reduce-scatter and adds the average into shard.grad.
  void finish_reduce();
  // Whether finish_reduce() would not block (none in flight, or done).
  // With HSDP, a finished reduce-scatter starts the all-reduce across
  // replicas.
  bool reduce_complete();
  // Bytes of this unit's unsharded gradient buffers now (in reduction, or
  // kept under no_sync).
  int64_t gradient_bytes() const;
  void reset_iteration();

  // Collective: every parameter's full value in the shard's dtype (the
  // master copy, not the compute-dtype one the module sees), in params()
  // order.
  std::vector<at::Tensor> gather_master();
  // This rank's shard from full-size values, in params() order.
  void load_full(const std::vector<at::Tensor>& values);

 private:
  void free_storage();
  void make_views(at::ScalarType dtype);

  std::string name_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<int64_t> offsets_;
  ProcessGroup& group_;
  at::ScalarType compute_dtype_, reduce_dtype_;
  int64_t numel_ = 0, slice_ = 0;
  bool trainable_ = false;

  at::Tensor shard_;    // [slice_], the parameters' dtype; a leaf the optimizer steps on
  at::Tensor full_;     // [slice_ * size], compute dtype; storage freed when resharded
  size_t full_bytes_ = 0;
  bool allocated_ = false;
  WorkPtr gather_work_;
  at::Tensor gather_input_;  // the shard cast to the compute dtype, alive while gathering

  std::vector<compat::NodePtr> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  std::vector<bool> has_grad_;
  size_t grads_ = 0, trainable_count_ = 0;
  bool reduced_ = false;
  WorkPtr reduce_work_;
  ProcessGroup* replicas_ = nullptr;  // HSDP
  std::function<WorkPtr(at::Tensor)> replica_average_;  // HSDP by another (replicate_with)
  WorkPtr replica_work_;              // the average across replicas
  void start_replica_reduce();
  at::Tensor reduce_input_, reduce_output_;
  at::Tensor unsynced_;  // flat gradients accumulated under no_sync
};

}  // namespace dtrain::fsdp
