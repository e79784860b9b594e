#pragma once

// What a PipelineStage keeps: its module, its place, and the shapes of the
// current step's microbatches (learnt anew each step).

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "dtrain/pipelining.h"

namespace dtrain::pipelining::detail {

struct TensorShape {
  bool known = false;
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
};

struct StageState {
  StageModule module;
  int index = 0;
  int num_stages = 1;
  std::shared_ptr<ProcessGroup> group;
  // Where received activations and gradients go: the device of the
  // module's first parameter (the CPU for a module without parameters).
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  TensorShape input;   // of one microbatch, as received from the previous stage
  TensorShape output;  // of one microbatch, as sent to the next stage
};

// The tensors a step accumulates gradients into.
inline std::vector<at::Tensor> parameters_of(const StageModule& m) {
  return m.parameters ? m.parameters() : m.module->parameters();
}

}  // namespace dtrain::pipelining::detail
