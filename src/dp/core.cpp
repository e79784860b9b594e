// DataParallelCore: checks, then hands a batch to the cpu or device engine.

#include <c10/core/DeviceGuard.h>

#include "common/cpu_memory.h"
#include "common/enforce.h"
#include "common/logging.h"
#include "dp/cpu_parallel.h"
#include "dp/device_parallel.h"
#include "dp/placement.h"
#include "dp/replica_pool.h"
#include "dp/replicas.h"
#include "dtrain/data_parallel.h"

namespace dtrain::detail {

struct DataParallelCore::Impl {
  DataParallelOptions options;
  dp::Placement placement;
  std::unique_ptr<dp::ReplicaSet> replicas;
  // Shared with the grad_fn of cpu-mode outputs, which may outlive us.
  std::shared_ptr<dp::ReplicaPool> pool;
};

DataParallelCore::DataParallelCore(std::shared_ptr<torch::nn::Module> module,
                                   const DataParallelOptions& options, ModuleOps ops)
    : impl_(std::make_unique<Impl>()) {
  apply_cpu_memory_policy();
  auto& s = *impl_;
  s.options = options;
  s.placement = dp::resolve_placement(options);
  const auto& devices = s.placement.devices;
  s.replicas = std::make_unique<dp::ReplicaSet>(std::move(module), devices, ops);
  if (devices.size() > 1)
    s.pool = std::make_shared<dp::ReplicaPool>(devices.size(),
                                               /*single_intra_op_thread=*/s.placement.cpu);
  DTRAIN_LOG_INFO("dp: ", devices.size(), " replica(s) of ", s.replicas->original().name(), " on ",
                  s.placement.cpu ? "CPU threads" : detail::join(devices), ", outputs on ",
                  s.placement.output);
}

DataParallelCore::~DataParallelCore() = default;

const std::vector<c10::Device>& DataParallelCore::devices() const { return impl_->placement.devices; }
c10::Device DataParallelCore::output_device() const { return impl_->placement.output; }

at::Tensor DataParallelCore::forward(const at::Tensor& input) {
  auto& s = *impl_;
  const auto& devices = s.placement.devices;
  const int64_t dim = s.options.dim();
  DTRAIN_CHECK_ARG(input.defined(), "DataParallel::forward: the input is an undefined tensor");
  DTRAIN_CHECK_ARG(dim >= -input.dim() && dim < input.dim(), "DataParallel::forward: dim ", dim,
                   " is out of range for an input of shape ", input.sizes());
  const int64_t rows = input.size(dim);
  DTRAIN_CHECK_ARG(rows > 0, "DataParallel::forward: the input has size 0 along dim ", dim,
                   " (shape ", input.sizes(), "); there is nothing to split across ",
                   devices.size(), " replica(s)");
  DTRAIN_CHECK_ARG(!s.placement.cpu || input.device().is_cpu(),
                   "DataParallel::forward: the input is on ", input.device(),
                   "; cpu_replicas take CPU inputs");
  s.replicas->check_original(devices[0]);

  const auto sizes = dp::chunk_sizes(rows, static_cast<int64_t>(devices.size()));
  if (s.placement.cpu) {
    // One chunk: the module itself, on the caller's thread.
    if (sizes.size() == 1) return s.replicas->forward(0, input);
    return dp::cpu_parallel_forward(*s.replicas, s.pool, input, sizes, dim);
  }
  if (sizes.size() == 1) {
    c10::OptionalDeviceGuard guard(devices[0]);
    return s.replicas->forward(0, input.to(devices[0])).to(s.placement.output);
  }
  return dp::device_parallel_forward(*s.replicas, *s.pool, devices, s.placement.output, input,
                                     sizes, dim);
}

}  // namespace dtrain::detail
