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
  std::shared_ptr<ProcessGroup> group;
  std::vector<Fragment> fragments;
  int64_t local_step = 0, peak_bytes = 0;

  Impl(torch::optim::Optimizer& inner, torch::optim::Optimizer& outer, const DiLoCoOptions& options)
      : inner(inner), outer(outer), options(options),
        group(options.group() ? options.group() : default_group()) {}

  void check_partition() const;
  void agree_across_replicas();
  void prepare(Fragment& f);
  void sync(Fragment& f);
};

}  // namespace dtrain::local_sgd
