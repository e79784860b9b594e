#include "backends/auto/routing_group.h"

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <utility>
#include <vector>

#include "common/enforce.h"
#include "common/logging.h"
#include "core/backend_registry.h"
#include "dtrain/distributed.h"
#include "dtrain/store/prefix_store.h"

namespace dtrain::device_routing {
namespace {

// Host copies of one operation's tensors: inputs copied out when issued,
// outputs copied back when the CPU work has succeeded. The host copies of
// CUDA tensors are in pinned memory (libtorch's caching host allocator, so
// reused from step to step): the copies run at the bus's speed, where
// pageable memory takes several times longer (on an H100, two ranks
// sharing the GPU staged DDP's 537 MB of gradients a step at 0.47x gloo's
// samples/s through pageable memory).
class Staging {
 public:
  static at::Tensor host_like(const at::Tensor& t) {
    return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(t.is_cuda()));
  }
  // Read only: a copy on the host (a fresh one even for a CPU tensor).
  at::Tensor in(const at::Tensor& t) {
    auto host = host_like(t);
    host.copy_(t);  // waits for the kernels that produced t on the caller's stream
    return host;
  }
  // Written by the operation (and read first when `read`).
  at::Tensor out(const at::Tensor& t, bool read) {
    at::Tensor host = read ? in(t) : host_like(t);
    back_.emplace_back(t, host);
    return host;
  }
  // A Work that ends once `inner` has and the results are back in place.
  WorkPtr finish(const std::string& description, const WorkPtr& inner, bool is_recv = false) {
    auto work = std::make_shared<Work>(description + " (staged through host memory)");
    // A wait on this work is a wait on the inner one (a send's or recv's
    // timeout starts there).
    work->on_first_wait([inner] { inner->note_waiting(); });
    inner->on_finish([work, inner, is_recv, back = std::move(back_)](const std::exception_ptr& error) {
      std::exception_ptr failure = error;
      if (!failure) {
        try {
          for (const auto& [device, host] : back) device.copy_(host);
          if (is_recv) work->set_source_rank(inner->source_rank());
        } catch (...) {
          failure = std::current_exception();
        }
      }
      work->finish(failure);
    });
    return work;
  }

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> back_;
};

}  // namespace

std::string nccl_unusable_reason(int ranks_here) {
  if (!at::globalContext().hasCUDA()) return "no CUDA device is visible to libtorch";
  const int gpus = at::detail::getCUDAHooks().getNumGPUs();
  if (ranks_here > gpus)
    return detail::cat(ranks_here, " ranks on this machine share ", gpus,
                       " GPU(s), and NCCL takes one GPU per rank");
  return detail::backend_unavailable_reason("nccl");
}

namespace {
thread_local bool routing_forced = false;
}  // namespace

void set_thread_routing_forced(bool forced) { routing_forced = forced; }
bool thread_routing_forced() { return routing_forced; }

// Through the store, not the CPU group: a collective here would be the
// group's first (#0 in every error and dump, before the user's first) and
// would open DTRAIN_TIMELINE's file before the rank is known. Each rank
// counts itself in "cuda/unusable" if it cannot run NCCL, then in
// "cuda/arrived"; the last to arrive publishes the count.
std::shared_ptr<ProcessGroup> route_by_device(std::shared_ptr<ProcessGroup> cpu,
                                              std::shared_ptr<Store> store, int ranks_here,
                                              const GroupOptions& options) {
  const std::string why = nccl_unusable_reason(ranks_here);
  if (!why.empty()) store->add("cuda/unusable", 1);
  if (store->add("cuda/arrived", 1) == cpu->size())
    store->set("cuda/verdict", std::to_string(store->add("cuda/unusable", 0)));
  const bool nccl = store->get_string("cuda/verdict") == "0";
  if (nccl)
    DTRAIN_LOG_INFO("auto: group '", options.name(), "': CUDA tensors through nccl");
  else
    DTRAIN_LOG_INFO("auto: group '", options.name(), "': CUDA tensors staged through host memory (",
                    why.empty() ? "another rank cannot use NCCL" : why, ")");
  return std::make_shared<RoutingProcessGroup>(std::move(cpu), std::move(store),
                                               nccl ? CudaPath::kNccl : CudaPath::kStaged, options);
}

RoutingProcessGroup::RoutingProcessGroup(std::shared_ptr<ProcessGroup> cpu,
                                         std::shared_ptr<Store> store, CudaPath cuda_path,
                                         GroupOptions options, RoutingOptions routing)
    : ProcessGroup(cpu->rank(), cpu->size(), std::move(options)),
      cpu_(std::move(cpu)),
      store_(std::move(store)),
      cuda_path_(cuda_path),
      routing_(routing) {
  hide_diagnostics(*cpu_);
}

std::string RoutingProcessGroup::backend_name() const {
  return detail::cat(cpu_->backend_name(), "; CUDA tensors: ",
                     cuda_path_ == CudaPath::kNccl ? "nccl" : "staged through host memory");
}

bool RoutingProcessGroup::supports(c10::DeviceType type) const {
  return type == c10::DeviceType::CPU || type == c10::DeviceType::CUDA;
}

ProcessGroup* RoutingProcessGroup::direct(const at::Tensor& t, bool collective) {
  if (t.device().is_cpu()) return routing_.stage_cpu_tensors ? nullptr : cpu_.get();
  if (cuda_path_ == CudaPath::kStaged) return nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!nccl_) {
    DTRAIN_CHECK_ARG(collective, "group '", name(), "' (auto): the first operation on CUDA tensors "
                     "must be a collective: NCCL's communicator is created by every rank at once");
    auto options = GroupOptions(this->options()).name(name() + "/nccl");
    nccl_ = create_process_group("nccl", std::make_shared<PrefixStore>("cuda", store_), rank(),
                                 size(), options);
    hide_diagnostics(*nccl_);
  }
  return nccl_.get();
}

// Whole operations, as descriptors: a barrier (no tensors) to the CPU
// group; an operation on tensors to the group of their device, or staged.
WorkPtr RoutingProcessGroup::post(const Call& call, Op op) {
  if (op.inputs.empty() && op.outputs.empty()) return cpu_->issue(std::move(op), call.timeout);
  const auto& probe = op.inputs.empty() ? op.outputs.front() : op.inputs.front();
  if (auto* g = direct(probe, is_collective(op.type))) return g->issue(std::move(op), call.timeout);
  const bool is_recv = op.type == OpType::RECV;
  Staging s;
  for (auto& t : op.inputs) t = s.in(t);
  for (auto& t : op.outputs) {
    // Only the root's tensor changes in a reduce; a broadcast's is read at
    // its root only; the other in-place operations read what they write.
    const bool written = op.type != OpType::REDUCE || rank() == op.root;
    const bool in_place = op.type == OpType::ALL_REDUCE || op.type == OpType::REDUCE ||
                          (op.type == OpType::BROADCAST && rank() == op.root);
    t = written ? s.out(t, in_place) : s.in(t);
  }
  return s.finish(call.description, cpu_->issue(std::move(op), call.timeout), is_recv);
}

}  // namespace dtrain::device_routing
