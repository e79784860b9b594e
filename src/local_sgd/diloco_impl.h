#pragma once

// DiLoCo's state (dtrain/local_sgd.h), shared by diloco.cpp (the
// algorithm) and diloco_state.cpp (its checkpoint entries).

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "dtrain/distributed.h"
#include "dtrain/local_sgd.h"

namespace dtrain::local_sgd {

struct Fragment {
  std::vector<at::Tensor> params;
  at::Tensor global;  // flat, the parameters' dtype and device
  at::Tensor delta;   // flat pseudo-gradient being averaged (bf16 with bf16_exchange)
  WorkPtr work;       // its average, in flight
  bool arrived = false;  // its average is in delta, not applied yet (waited for by a save, or loaded)
  int64_t offset = 0; // its syncs: the steps offset, offset + H, ... (then sync_delay later)
};

struct DiLoCo::Impl {
  torch::optim::Optimizer& inner;
  torch::optim::Optimizer& outer;
  DiLoCoOptions options;
  std::shared_ptr<ProcessGroup> group;  // null with a manager
  std::vector<Fragment> fragments;
  int64_t local_step = 0, peak_bytes = 0;

  Impl(torch::optim::Optimizer& inner, torch::optim::Optimizer& outer, const DiLoCoOptions& options)
      : inner(inner), outer(outer), options(options),
        group(options.group() || options.manager() ? options.group() : default_group()) {}

  // The fragment whose sync is due at inner step `step` (sync_delay 0);
  // null when none.
  Fragment* due_at(int64_t step);

  void check_partition() const;
  void agree_across_replicas();
  void prepare(Fragment& f);
  void sync(Fragment& f);
  // The outer step of `f` on `average` (the replicas' mean pseudo-gradient,
  // in the global values' dtype).
  void apply(Fragment& f, const at::Tensor& average);

  // With a manager (diloco_ft.cpp): the options it refuses, and one sync of
  // the fragment due at this step as the manager's step.
  void check_for_manager() const;
  void sync_in_quorum(int64_t step);
};

}  // namespace dtrain::local_sgd
