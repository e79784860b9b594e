#pragma once

// FSDPCore's state, shared by core.cpp (units and scheduling) and
// state_dict.cpp (state dicts, clipping, summoning full parameters).

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "dtrain/fsdp.h"
#include "fsdp/flat_unit.h"

namespace dtrain::detail {

struct FSDPCore::Impl {
  static constexpr size_t kNone = std::numeric_limits<size_t>::max();

  std::shared_ptr<ProcessGroup> group;      // the shards'
  std::shared_ptr<ProcessGroup> replicate;  // HSDP's replicas, or null
  FSDPOptions options;
  std::vector<std::shared_ptr<fsdp::FlatUnit>> units;  // the root's first when it has one
  // The units each FullyShard module (null: the root) gathers and frees
  // around its forward: its own, then those of submodule_groups' modules
  // without hooks of their own that it encloses (its riders).
  std::unordered_map<const FSDPModule*, std::vector<size_t>> units_of;
  std::vector<FSDPModule*> attached;
  std::vector<std::string> buffer_names;
  std::vector<at::Tensor> buffers;
  bool sync = true;
  bool microbatching = false;  // between begin_ and end_microbatches()

  // The iteration: forward (units in the order they ran), then backward.
  std::vector<bool> ran_forward;
  std::vector<size_t> forward_order, last_forward_order;
  std::vector<size_t> backward_order, last_backward_order;
  bool expect_backward = false;   // a forward with gradients ran; its backward has not ended
  bool backward_running = false;  // the end-of-backward callback is queued
  std::vector<fsdp::FlatUnit*> reducing;  // reduce-scatters maybe in flight, oldest first
  FSDPStats current, last;        // this iteration's counts, the last complete one's

  // Gathers a unit (nothing if it is); `ahead`: a prefetch.
  void gather(size_t index, bool ahead);

  // The shard group and (HSDP) the replicate group from the options.
  void resolve_groups();
  void build_units(torch::nn::Module& model, FSDPCore* core);
  // The unit a ShardedConstruction built for `module`, taken over.
  std::shared_ptr<fsdp::FlatUnit> adopt(FSDPModule& module, const std::string& path,
                                        const std::vector<at::Tensor>& params,
                                        std::vector<std::string> names, const ProcessGroup& over);
  // submodule_groups checked against the model (every path a module, each
  // group holding this rank, no HSDP).
  void check_submodule_groups(torch::nn::Module& model) const;
  const std::vector<size_t>& indices_of(const FSDPModule* module) const;
  void begin_iteration();
  void prefetch_after(const std::vector<size_t>& order, size_t index);
  void queue_finalize();
  void pre_backward(const std::vector<size_t>& indices);
  void grad_ready(fsdp::FlatUnit& unit, size_t index);
  void reduce(fsdp::FlatUnit& unit);
  void settle_reductions(bool wait);

  void finish_backward();
  void end_iteration();
};

}  // namespace dtrain::detail
