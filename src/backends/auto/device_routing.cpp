#include "backends/auto/device_routing.h"

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

// Through the store, not the CPU backend: a collective here would be the
// group's first (#0 in every error and dump, before the user's first) and
// would open DTRAIN_TIMELINE's file before the rank is known. Each rank
// counts itself in "cuda/unusable" if it cannot run NCCL, then in
// "cuda/arrived"; the last to arrive publishes the count.
std::shared_ptr<ProcessGroup> route_by_device(BackendPtr cpu, std::shared_ptr<Store> store,
                                              int ranks_here, const GroupOptions& options) {
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
  const int rank = cpu->rank(), size = cpu->size();
  BackendPtr cuda;
  if (nccl) cuda = std::make_shared<NcclOnFirstUse>(std::move(store), rank, size, options);
  else cuda = std::make_shared<StagedBackend>(cpu, c10::DeviceType::CUDA);
  return std::make_shared<ProcessGroup>(
      rank, size, options,
      DeviceBackends{{c10::DeviceType::CPU, std::move(cpu)}, {c10::DeviceType::CUDA, cuda}});
}

StagedBackend::StagedBackend(BackendPtr cpu, c10::DeviceType device)
    : Backend(cpu->rank(), cpu->size(), cpu->options()), cpu_(std::move(cpu)), device_(device) {}

// The whole operation through host memory, on the CPU backend.
WorkPtr StagedBackend::post(const Call& call, Op op) {
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
  return s.finish(call.description, cpu_->post(call, std::move(op)), is_recv);
}

NcclOnFirstUse::NcclOnFirstUse(std::shared_ptr<Store> store, int rank, int size,
                               GroupOptions options)
    : Backend(rank, size, std::move(options)), store_(std::move(store)) {}

bool NcclOnFirstUse::averages(c10::ScalarType dtype) const { return at::isFloatingType(dtype); }

void NcclOnFirstUse::abort(std::exception_ptr error) {
  BackendPtr made;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!aborted_) aborted_ = error;
    made = nccl_;
  }
  if (made) made->abort(std::move(error));
}

Backend& NcclOnFirstUse::nccl(bool collective) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_ && !nccl_) std::rethrow_exception(aborted_);
  if (!nccl_) {
    DTRAIN_CHECK_ARG(collective, "group '", name(), "' (auto): the first operation on CUDA tensors "
                     "must be a collective: NCCL's communicator is created by every rank at once");
    auto options = GroupOptions(this->options()).name(name() + "/nccl");
    nccl_ = detail::create_backend("nccl", std::make_shared<PrefixStore>("cuda", store_), rank(),
                                   size(), options);
  }
  return *nccl_;
}

WorkPtr NcclOnFirstUse::post(const Call& call, Op op) {
  return nccl(is_collective(op.type)).post(call, std::move(op));
}

std::vector<WorkPtr> NcclOnFirstUse::post_batch(const std::vector<Call>& calls,
                                                std::vector<Op> ops) {
  return nccl(/*collective=*/false).post_batch(calls, std::move(ops));
}

}  // namespace dtrain::device_routing
