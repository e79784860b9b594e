#pragma once

// An autocast region on the CPU in bfloat16, entered and left as
// torch.autocast("cpu") is (its casts cached until the outermost one ends).

#include <ATen/autocast_mode.h>
#include <torch/version.h>

namespace dtrain::testing {

class CpuAutocast {
 public:
  CpuAutocast() {
    set(true);
    at::autocast::increment_nesting();
  }
  ~CpuAutocast() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    set(false);
  }
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;

 private:
  static void set(bool on) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_enabled(at::kCPU, on);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
#else
    at::autocast::set_cpu_enabled(on);
    at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
#endif
  }
};

}  // namespace dtrain::testing
