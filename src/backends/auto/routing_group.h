#pragma once

// Backend "auto" on a machine with CUDA: CPU tensors go to the CPU group
// (shm, or shm + tcp across machines), CUDA tensors to NCCL when every
// rank can use it, else through host memory on the CPU group (PyTorch's
// "cpu:gloo,cuda:nccl", with a fallback for one GPU shared by several
// ranks, which NCCL refuses).
//
// Which path CUDA tensors take is agreed at construction, through the
// store (no collective: the user's first operation stays #0): each rank
// says whether it could run NCCL (a CUDA device, the nccl plug-in, no more
// ranks on its machine than GPUs); all must. The inner groups record
// nothing themselves: each operation is one flight-recorder entry and one
// timeline span, this group's. The NCCL
// group itself is created on the first CUDA collective, by every rank at
// once (point-to-point first on CUDA tensors is refused: NCCL's
// communicator needs every rank).
//
// Staged, an operation copies its CUDA inputs to the host when it is
// issued (after the kernels that produced them, on the caller's current
// stream), runs on the CPU group, and copies the results back before its
// Work completes: wait() blocks the host, as CPU work does.

#include <memory>
#include <mutex>
#include <string>

#include "dtrain/process_group.h"
#include "dtrain/store/store.h"

namespace dtrain::device_routing {

enum class CudaPath { kNccl, kStaged };

struct RoutingOptions {
  // Tests: CPU tensors take the staged path too (copied out and back), so
  // the staging is exercised where no GPU is.
  bool stage_cpu_tensors = false;
};

class RoutingProcessGroup final : public ProcessGroup {
 public:
  RoutingProcessGroup(std::shared_ptr<ProcessGroup> cpu, std::shared_ptr<Store> store,
                      CudaPath cuda_path, GroupOptions options,
                      RoutingOptions routing = RoutingOptions());

  std::string backend_name() const override;
  int max_tag() const override { return cpu_->max_tag(); }
  bool supports(c10::DeviceType type) const override;
  CudaPath cuda_path() const { return cuda_path_; }

 protected:
  // Forwards each operation whole (its descriptor), to one inner group.
  WorkPtr post(const Call& call, Op op) override;

 private:
  // Where an operation on `t` goes: null for the staged path.
  ProcessGroup* direct(const at::Tensor& t, bool collective);

  std::shared_ptr<ProcessGroup> cpu_;
  std::shared_ptr<Store> store_;
  CudaPath cuda_path_;
  RoutingOptions routing_;
  std::mutex mutex_;
  std::shared_ptr<ProcessGroup> nccl_;  // created on the first CUDA collective
};

// Whether this rank could run NCCL with `ranks_here` ranks on its machine;
// "" when it could, else why not.
std::string nccl_unusable_reason(int ranks_here);

// Agrees (through `store`) on the CUDA path and wraps `cpu`.
std::shared_ptr<ProcessGroup> route_by_device(std::shared_ptr<ProcessGroup> cpu,
                                              std::shared_ptr<Store> store, int ranks_here,
                                              const GroupOptions& options);

// Tests: auto wraps its CPU group in the routing layer on this thread even
// where libtorch has no CUDA, as it does on every CUDA-enabled libtorch.
void set_thread_routing_forced(bool forced);
bool thread_routing_forced();

}  // namespace dtrain::device_routing
