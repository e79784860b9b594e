#pragma once

// Backend "auto" on a machine with CUDA: a group whose device map sends CPU
// tensors to the CPU backend (shm, or shm + tcp across machines) and CUDA
// tensors to NCCL when every rank can use it, else through host memory to
// the same CPU backend (PyTorch's "cpu:gloo,cuda:nccl", with a fallback for
// one GPU shared by several ranks, which NCCL refuses). Each is an entry of
// the group's map (process_group.h), behind the one front door: each
// operation is one flight-recorder entry, one timeline span and one check.
//
// Which path CUDA tensors take is agreed at construction, through the
// store (no collective: the user's first operation stays #0): each rank
// says whether it could run NCCL (a CUDA device, the nccl plug-in, no more
// ranks on its machine than GPUs); all must. The NCCL backend itself is
// created on the first CUDA collective, by every rank at once
// (point-to-point first on CUDA tensors is refused: NCCL's communicator
// needs every rank).
//
// Staged, an operation copies its CUDA inputs to the host when it is
// issued (after the kernels that produced them, on the caller's current
// stream), runs on the CPU backend, and copies the results back before its
// Work completes: wait() blocks the host, as CPU work does.

#include <memory>
#include <mutex>
#include <string>

#include "dtrain/backend.h"
#include "dtrain/process_group.h"
#include "dtrain/store/store.h"

namespace dtrain::device_routing {

// Runs operations on `device` tensors through host memory on `cpu`.
class StagedBackend final : public Backend {
 public:
  StagedBackend(BackendPtr cpu, c10::DeviceType device);
  std::string backend_name() const override { return "staged through host memory"; }
  bool supports(c10::DeviceType type) const override { return type == device_; }
  int max_tag() const override { return cpu_->max_tag(); }
  bool averages(c10::ScalarType dtype) const override { return cpu_->averages(dtype); }
  void abort(std::exception_ptr error) override { cpu_->abort(std::move(error)); }
  WorkPtr post(const Call& call, Op op) override;

 private:
  BackendPtr cpu_;
  c10::DeviceType device_;
};

// The NCCL backend, created on the first collective on CUDA tensors.
class NcclOnFirstUse final : public Backend {
 public:
  NcclOnFirstUse(std::shared_ptr<Store> store, int rank, int size, GroupOptions options);
  std::string backend_name() const override { return "nccl"; }
  bool supports(c10::DeviceType type) const override { return type == c10::DeviceType::CUDA; }
  // NCCL averages floating types itself (ncclAvg).
  bool averages(c10::ScalarType dtype) const override;
  // The communicator's, once made; before that, later uses fail.
  void abort(std::exception_ptr error) override;
  WorkPtr post(const Call& call, Op op) override;
  std::vector<WorkPtr> post_batch(const std::vector<Call>& calls, std::vector<Op> ops) override;

 private:
  Backend& nccl(bool collective);

  std::shared_ptr<Store> store_;
  std::mutex mutex_;
  BackendPtr nccl_;
  std::exception_ptr aborted_;  // abort() before the communicator was made
};

// Whether this rank could run NCCL with `ranks_here` ranks on its machine;
// "" when it could, else why not.
std::string nccl_unusable_reason(int ranks_here);

// Agrees (through `store`) on the CUDA path; the group over `cpu` and it.
std::shared_ptr<ProcessGroup> route_by_device(BackendPtr cpu, std::shared_ptr<Store> store,
                                              int ranks_here, const GroupOptions& options);

// Tests: auto routes by device on this thread even where libtorch has no
// CUDA, as it does on every CUDA-enabled libtorch.
void set_thread_routing_forced(bool forced);
bool thread_routing_forced();

}  // namespace dtrain::device_routing
