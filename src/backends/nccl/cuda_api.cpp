#include "backends/nccl/cuda_api.h"

#ifdef DTRAIN_HAVE_C10_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <optional>

#include "common/enforce.h"
#include "dtrain/errors.h"

namespace dtrain::nccl_backend {

namespace {
std::string describe(cudaError_t status) {
  return detail::cat(cudaGetErrorString(status), " (cudaError ", static_cast<int>(status), ")");
}
}  // namespace

void check_cuda(cudaError_t status, const char* call) {
  if (status != cudaSuccess) throw NetworkError(detail::cat(call, ": ", describe(status)));
}

int usable_device_count() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();  // not sticky: leave no error behind for later calls
    throw BackendUnavailable(detail::cat("nccl: no usable CUDA device: cudaGetDeviceCount: ",
                                         describe(status)));
  }
  if (count == 0) throw BackendUnavailable("nccl: no usable CUDA device: cudaGetDeviceCount found 0");
  return count;
}

bool have_torch_cuda() {
#ifdef DTRAIN_HAVE_C10_CUDA
  return true;
#else
  return false;
#endif
}

cudaStream_t current_stream(int device) {
#ifdef DTRAIN_HAVE_C10_CUDA
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
  (void)device;
  throw InternalError("nccl: current_stream needs a CUDA-enabled libtorch");
#endif
}

DeviceScope::DeviceScope(int device) {
  check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
}

DeviceScope::~DeviceScope() {
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
}

struct StreamScope::Impl {
#ifdef DTRAIN_HAVE_C10_CUDA
  explicit Impl(cudaStream_t stream, int device)
      : guard(c10::cuda::getStreamFromExternal(stream, static_cast<c10::DeviceIndex>(device))) {}
  c10::cuda::CUDAStreamGuard guard;
#endif
};

StreamScope::StreamScope(cudaStream_t stream, int device) {
#ifdef DTRAIN_HAVE_C10_CUDA
  impl_ = std::make_unique<Impl>(stream, device);
#else
  (void)stream, (void)device;
  throw InternalError("nccl: StreamScope needs a CUDA-enabled libtorch");
#endif
}

StreamScope::~StreamScope() = default;

Stream::Stream(int device) : device_(device) {
  DeviceScope scope(device_);
  check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
}

Stream::~Stream() {
  if (!stream_) return;
  DeviceScope scope(device_);
  cudaStreamDestroy(stream_);
}

Event::Event(int device) : device_(device) {
  DeviceScope scope(device_);
  check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
}

Event::~Event() {
  if (event_) cudaEventDestroy(event_);
}

void Event::record(cudaStream_t stream) { check_cuda(cudaEventRecord(event_, stream), "cudaEventRecord"); }

void Event::block(cudaStream_t stream) const {
  check_cuda(cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent");
}

bool Event::done() const {
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaErrorNotReady) return false;
  check_cuda(status, "cudaEventQuery");
  return true;
}

}  // namespace dtrain::nccl_backend
