// Option validation for DataParallel: resolves cpu_replicas / device_ids /
// output_device to one device per replica.

#include "dp/placement.h"

#include <torch/cuda.h>

#include "common/enforce.h"

namespace dtrain::dp {

namespace {

c10::Device cuda(int64_t index) { return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index)); }

Placement cpu_placement(const DataParallelOptions& options) {
  const int64_t n = *options.cpu_replicas();
  DTRAIN_CHECK_ARG(n >= 1, "DataParallelOptions::cpu_replicas must be at least 1, got ", n);
  DTRAIN_CHECK_ARG(options.device_ids().empty(),
                   "DataParallel: cpu_replicas and device_ids are exclusive (cpu_replicas(", n,
                   ") with device_ids {", detail::join(options.device_ids()), "})");
  DTRAIN_CHECK_ARG(!options.output_device().has_value(),
                   "DataParallel: output_device applies to CUDA replicas; with cpu_replicas the "
                   "outputs are always gathered on the CPU");
  Placement p;
  p.cpu = true;
  p.devices.assign(static_cast<size_t>(n), c10::Device(c10::kCPU));
  p.output = c10::Device(c10::kCPU);
  return p;
}

}  // namespace

Placement resolve_placement(const DataParallelOptions& options) {
  if (options.cpu_replicas().has_value()) return cpu_placement(options);

  // torch::cuda::device_count() is 0 (not an error) in CPU-only builds.
  const int64_t available = static_cast<int64_t>(torch::cuda::device_count());
  std::vector<int64_t> ids = options.device_ids();
  if (ids.empty()) {
    DTRAIN_CHECK_ARG(available > 0,
                     "DataParallel: no CUDA device is available (torch::cuda::device_count() is "
                     "0); to run replicas on CPU threads use DataParallelOptions().cpu_replicas(n)");
    for (int64_t i = 0; i < available; ++i) ids.push_back(i);
  }
  Placement p;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t id = ids[i];
    DTRAIN_CHECK_ARG(id >= 0, "DataParallel: device_ids contains ", id,
                     "; CUDA device indices are >= 0");
    DTRAIN_CHECK_ARG(id < available, "DataParallel: device_ids contains ", cuda(id), " but only ",
                     available, " CUDA device(s) are available");
    // A device may appear more than once: its replicas share it (and its
    // current stream), as on a machine with one GPU.
    p.devices.push_back(cuda(id));
  }
  const int64_t out = options.output_device().value_or(ids.front());
  DTRAIN_CHECK_ARG(out >= -1 && out < available, "DataParallel: output_device is ", out,
                   " but only ", available, " CUDA device(s) are available (-1 means the CPU)");
  p.output = out == -1 ? c10::Device(c10::kCPU) : cuda(out);
  return p;
}

std::vector<int64_t> chunk_sizes(int64_t total, int64_t replicas) {
  DTRAIN_ENFORCE(total > 0 && replicas > 0);
  const int64_t n = std::min(total, replicas);
  std::vector<int64_t> sizes(static_cast<size_t>(n), total / n);
  for (int64_t i = 0; i < total % n; ++i) ++sizes[static_cast<size_t>(i)];
  return sizes;
}

}  // namespace dtrain::dp
