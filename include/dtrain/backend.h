#pragma once

// Backend: what runs a process group's operations on one type of device
// (c10d's Backend). The process group (process_group.h) is the front door:
// it checks every operation, numbers it, records it (flight recorder,
// timeline, DTRAIN_DEBUG=DETAIL's fingerprint), stages non-contiguous
// tensors, lowers PREMUL_SUM, and AVG where the backend does not average,
// and hands the backend of the tensors' device one validated Call. A
// backend only runs it: post() returns its Work at once.
//
// dtrain's own: the fabric's (tcp, shm, auto's CPU tensors), mpi, nccl.
// Your own: derive from Backend, write post() or the hooks below (one per
// operation; DTRAIN_BACKEND_HOOKS declares them all) and register it:
//
//   register_backend("mine", {c10::DeviceType::CPU},
//                    [](std::shared_ptr<Store> store, int rank, int size,
//                       const GroupOptions& options) {
//                      return std::make_shared<MyBackend>(store, rank, size, options);
//                    });
//
// create_process_group("mine", ...) and init_process_group then give a
// ProcessGroup over it. (Backends written before this interface, as
// ProcessGroup subclasses registered with the two-argument register_backend,
// still work: distributed.h.)

#include <c10/core/Device.h>

#include <memory>
#include <string>
#include <vector>

#include "dtrain/operation.h"
#include "dtrain/work.h"

namespace dtrain {
namespace detail {

// The per-operation hooks of a backend: post() hands each operation to its
// hook; a hook left out fails with BackendUnavailable naming the backend
// and the operation. Shared by Backend and, for backends written before it,
// ProcessGroup.
class OperationHooks {
 public:
  virtual ~OperationHooks() = default;

 protected:
  using Call = dtrain::Call;

  // Tensors are dense, contiguous, of one dtype and on a supported device;
  // lists have the sizes that process_group.h documents.
  virtual WorkPtr post(const Call& call, Op op);
  // A batch of sends and receives (batch_isend_irecv): by default each to
  // post(), in order; one work per operation.
  virtual std::vector<WorkPtr> post_batch(const std::vector<Call>& calls, std::vector<Op> ops);

  virtual WorkPtr do_all_reduce(const Call& call, at::Tensor tensor, ReduceOp op);
  virtual WorkPtr do_broadcast(const Call& call, at::Tensor tensor, int root);
  virtual WorkPtr do_reduce(const Call& call, at::Tensor tensor, int root, ReduceOp op);
  virtual WorkPtr do_all_gather(const Call& call, std::vector<at::Tensor> outputs,
                                at::Tensor input);
  virtual WorkPtr do_gather(const Call& call, std::vector<at::Tensor> outputs,
                            at::Tensor input, int root);
  virtual WorkPtr do_scatter(const Call& call, at::Tensor output,
                             std::vector<at::Tensor> inputs, int root);
  virtual WorkPtr do_reduce_scatter(const Call& call, at::Tensor output,
                                    std::vector<at::Tensor> inputs, ReduceOp op);
  virtual WorkPtr do_all_to_all(const Call& call, std::vector<at::Tensor> outputs,
                                std::vector<at::Tensor> inputs);
  // The flat forms; by default the list forms on views of the flat tensor
  // (no copy), which a backend may replace with a path of its own.
  virtual WorkPtr do_all_gather_into_tensor(const Call& call, at::Tensor output,
                                            at::Tensor input);
  virtual WorkPtr do_reduce_scatter_tensor(const Call& call, at::Tensor output, at::Tensor input,
                                           ReduceOp op);
  virtual WorkPtr do_barrier(const Call& call);
  virtual WorkPtr do_monitored_barrier(const Call& call, bool wait_all_ranks);
  virtual WorkPtr do_send(const Call& call, at::Tensor tensor, int dst, int tag);
  virtual WorkPtr do_recv(const Call& call, at::Tensor tensor, int src, int tag);

  // For the hooks' defaults: "backend 'x' (group 'y')", and the group's size.
  virtual std::string hooks_owner() const = 0;
  virtual int hooks_group_size() const = 0;
};

}  // namespace detail

class Backend : public detail::OperationHooks {
 public:
  ~Backend() override;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return options_.name(); }  // the group's
  std::chrono::milliseconds timeout() const { return options_.timeout(); }
  const GroupOptions& options() const { return options_; }

  // "tcp", "nccl", ...: what the group's backend_name() says of it.
  virtual std::string backend_name() const = 0;
  // Device types whose tensors it takes.
  virtual bool supports(c10::DeviceType type) const = 0;
  // The largest tag its send and recv take (ProcessGroup::max_tag()).
  virtual int max_tag() const;
  // Where the group's small control tensors go (ProcessGroup::control_device()).
  virtual c10::Device control_device() const { return c10::Device(c10::DeviceType::CPU); }
  // Whether it computes AVG of `dtype` itself; where not, the front door
  // hands it SUM and divides the result by the group's size (truncating
  // integers).
  virtual bool averages(c10::ScalarType dtype) const;
  // Breaks the group with `error` (ProcessGroup::abort); BackendUnavailable
  // where the backend cannot (mpi).
  virtual void abort(std::exception_ptr error);

  // One validated operation (see OperationHooks::post).
  WorkPtr post(const Call& call, Op op) override { return OperationHooks::post(call, std::move(op)); }
  std::vector<WorkPtr> post_batch(const std::vector<Call>& calls, std::vector<Op> ops) override {
    return OperationHooks::post_batch(calls, std::move(ops));
  }

 protected:
  Backend(int rank, int size, GroupOptions options);
  std::string hooks_owner() const override;
  int hooks_group_size() const override { return size_; }

 private:
  int rank_;
  int size_;
  GroupOptions options_;
};

using BackendPtr = std::shared_ptr<Backend>;

}  // namespace dtrain
