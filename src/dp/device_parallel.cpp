// Device mode: one replica per CUDA device, ordinary autograd.
//
// Written against c10::Device only, so it compiles into CPU-only builds;
// there it is unreachable (resolve_placement finds no device). It has not
// been run on GPUs in this repository's CI: see docs/data-parallel.md.
//
// Each forward, every replica k >= 1 gets fresh copies of the original
// parameters on its device, as nn.DataParallel's broadcast does, whose
// grad_fn sends their gradients back to the original parameters
// (ReplicaSet::link_params). Replica 0 is the original module, on
// devices[0]. Scatter (narrow + to) and gather (to + cat) are differentiable
// ops, so the whole step is one ordinary graph, and the engine's per-device
// threads run the replicas' backward in parallel by themselves.
//
// Each replica runs on the caller's current stream of its device, as
// PyTorch's parallel_apply does: work the caller queued on that stream (the
// input's copy, say) comes first, and what the caller queues after forward
// comes after the replica's kernels. The stream is read and set through
// c10's device-generic guard interface, so no c10_cuda is needed.

#include "dp/device_parallel.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <ATen/ThreadLocalState.h>

#include "common/enforce.h"

namespace dtrain::dp {

at::Tensor device_parallel_forward(ReplicaSet& replicas, ReplicaPool& pool,
                                   const std::vector<c10::Device>& devices, c10::Device output,
                                   const at::Tensor& input, const std::vector<int64_t>& sizes,
                                   int64_t dim) {
  const size_t n = sizes.size();
  DTRAIN_ENFORCE(n >= 2 && n <= replicas.size() && n <= pool.size() && n <= devices.size());
  replicas.refresh_state(n);
  replicas.link_params(n, /*share_storage=*/false);

  std::vector<at::Tensor> chunks(n), outputs(n);
  int64_t offset = 0;
  for (size_t i = 0; i < n; ++i) {
    chunks[i] = input.narrow(dim, offset, sizes[i]);  // differentiable: gradients reach the input
    offset += sizes[i];
  }
  std::vector<c10::Stream> streams;  // the caller's current stream on each device
  for (size_t i = 0; i < n; ++i)
    streams.push_back(c10::impl::getDeviceGuardImpl(devices[i].type())->getStream(devices[i]));
  const at::ThreadLocalState tls;
  std::vector<std::function<void()>> tasks;
  for (size_t i = 0; i < n; ++i)
    tasks.emplace_back([&, i] {
      at::ThreadLocalStateGuard tls_guard(tls);
      c10::StreamGuard stream_guard(streams[i]);  // sets the device too
      outputs[i] = replicas.forward(i, chunks[i].to(devices[i]));
    });
  pool.run(tasks);

  std::vector<at::Tensor> gathered;
  for (size_t i = 0; i < n; ++i) {
    DTRAIN_CHECK_ARG(outputs[i].defined(), "DataParallel: replica ", i, " (", devices[i],
                     ") returned an undefined tensor");
    DTRAIN_CHECK_ARG(outputs[i].dim() > 0, "DataParallel: replica ", i, " (", devices[i],
                     ") returned a scalar; outputs are gathered along dim ", dim,
                     ", so forward must return a tensor with at least one dimension");
    gathered.push_back(outputs[i].to(output));
  }
  return at::cat(gathered, dim);
}

}  // namespace dtrain::dp
