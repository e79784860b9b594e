// The front door's backends (dtrain/process_group.h): which one runs an
// operation (by its tensors' device), what the group says of them, and AVG
// lowered to SUM for a backend that does not average.

#include <ATen/ATen.h>

#include <algorithm>

#include "common/enforce.h"
#include "core/average.h"
#include "dtrain/process_group.h"

namespace dtrain {

ProcessGroup::ProcessGroup(int rank, int size, GroupOptions options, DeviceBackends backends)
    : ProcessGroup(rank, size, std::move(options)) {
  DTRAIN_CHECK_ARG(!backends.empty(), "group '", name(), "': no backend given");
  for (const auto& [type, backend] : backends)
    DTRAIN_CHECK_ARG(backend && backend->supports(type), "group '", name(), "': the backend for ",
                     c10::DeviceTypeName(type), " tensors is ",
                     backend ? "'" + backend->backend_name() + "', which does not take them"
                             : "null");
  backends_ = std::move(backends);
  auto cpu = backends_.find(c10::DeviceType::CPU);
  default_backend_ = (cpu != backends_.end() ? cpu : backends_.begin())->second.get();
  // Named once: every call's description carries it.
  backends_name_ = default_backend_->backend_name();
  for (const auto& [type, backend] : backends_)
    if (backend.get() != default_backend_)
      backends_name_ += detail::cat("; ", c10::DeviceTypeName(type), " tensors: ",
                                    backend->backend_name());
}

ProcessGroup::~ProcessGroup() = default;

BackendPtr ProcessGroup::backend(c10::DeviceType type) const {
  auto it = backends_.find(type);
  return it == backends_.end() ? nullptr : it->second;
}

std::string ProcessGroup::backend_name() const {
  DTRAIN_ENFORCE(default_backend_);  // a group that is its own backend names it itself
  return backends_name_;
}

void ProcessGroup::abort(const std::string& reason) {
  DTRAIN_CHECK_ARG(default_backend_ != nullptr, "ProcessGroup::abort: group '", name(),
                   "' is its own backend (backend_hooks.h), which cannot abort");
  const auto error = std::make_exception_ptr(NetworkError(detail::cat("group '", name(), "' was aborted: ", reason)));
  for (auto& [type, backend] : backends_) backend->abort(error);
}

bool ProcessGroup::supports(c10::DeviceType type) const { return backends_.count(type) != 0; }

c10::Device ProcessGroup::control_device() const {
  return default_backend_ ? default_backend_->control_device() : c10::Device(c10::kCPU);
}

std::string ProcessGroup::hooks_owner() const {
  return detail::cat("backend '", backend_name(), "' (group '", name(), "')");
}

Backend* ProcessGroup::backend_for(const Op& op) const {
  if (!default_backend_) return nullptr;
  const at::Tensor* probe = !op.inputs.empty()    ? &op.inputs.front()
                            : !op.outputs.empty() ? &op.outputs.front()
                                                  : nullptr;
  if (!probe) return default_backend_;
  auto it = backends_.find(probe->device().type());
  DTRAIN_ENFORCE(it != backends_.end());  // TensorChecks refused other devices
  return it->second.get();
}

namespace {

// The tensor AVG divides: the reduction's result on this rank, if any.
at::Tensor averaged_output(const Op& op, int rank) {
  switch (op.type) {
    case OpType::ALL_REDUCE: case OpType::REDUCE_SCATTER: case OpType::REDUCE_SCATTER_TENSOR:
      return op.outputs[0];
    case OpType::REDUCE:
      return rank == op.root ? op.outputs[0] : at::Tensor();
    default:
      return at::Tensor();
  }
}

// The division after the sum: on the thread that finishes CPU work, before
// its waiters wake (and before staged outputs are copied back); for device
// work, on the caller's current stream behind the work's end.
WorkPtr divide_when_done(WorkPtr work, at::Tensor output, int size) {
  if (!output.defined()) return work;
  if (!work->on_device()) {
    work->on_success([output, size] { divide_for_average(output, size); });
    return work;
  }
  try {
    work->wait();
  } catch (const Error&) {
    return work;  // keeps its error for the caller's wait()
  }
  divide_for_average(output, size);
  return work;
}

}  // namespace

WorkPtr ProcessGroup::dispatch(const Call& call, Op op) {
  Backend* backend = backend_for(op);
  if (!backend) return post(call, std::move(op));  // the group is its own backend
  if (op.reduce_op != ReduceOp::AVG || op.outputs.empty() ||
      backend->averages(op.outputs[0].scalar_type()))
    return backend->post(call, std::move(op));
  op.reduce_op = ReduceOp::SUM;
  auto output = averaged_output(op, rank_);
  return divide_when_done(backend->post(call, std::move(op)), std::move(output), size_);
}

}  // namespace dtrain
