#pragma once

// The CUDA runtime as the nccl backend uses it: checked calls (a failure
// names the call and CUDA's own words), RAII streams and events, and the
// caller's current stream, which only a CUDA-enabled libtorch knows
// (c10_cuda; DTRAIN_HAVE_C10_CUDA). Includes no torch header.

#include <cuda_runtime_api.h>

#include <memory>
#include <string>

namespace dtrain::nccl_backend {

// Throws NetworkError "<call>: <CUDA's error string> (cudaError <code>)".
void check_cuda(cudaError_t status, const char* call);

// How many CUDA devices this process can use. A machine without a driver or
// a device throws BackendUnavailable naming CUDA's error (cudaGetDeviceCount
// leaves its count untouched then, so only the status tells).
int usable_device_count();

// True when this build can order work after the caller's CUDA stream, which
// needs c10_cuda from a CUDA-enabled libtorch.
bool have_torch_cuda();

// The calling thread's current stream on `device` (c10's current stream).
// Only with have_torch_cuda().
cudaStream_t current_stream(int device);

// Makes `device` the calling thread's current CUDA device in its scope.
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
};

// Makes `stream` the current stream of the calling thread in its scope, so
// that ATen's CUDA kernels (copies, divisions) and its allocations go on it.
// Only with have_torch_cuda().
class StreamScope {
 public:
  StreamScope(cudaStream_t stream, int device);
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class Stream {
 public:
  explicit Stream(int device);  // non-blocking with respect to the legacy default stream
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
};

class Event {
 public:
  explicit Event(int device);  // timing disabled: cheapest to record and query
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(cudaStream_t stream);
  // Makes `stream` wait (on the device) for the last record().
  void block(cudaStream_t stream) const;
  // True once the recorded work has finished; throws on a CUDA error.
  bool done() const;

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
};

}  // namespace dtrain::nccl_backend
