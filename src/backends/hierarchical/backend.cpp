#include "backends/hierarchical/backend.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>

#include "backends/device_routing/routing_group.h"
#include "backends/tcp/backend.h"
#include "backends/shm/backend.h"
#include "transport/shm/node.h"
#include "common/enforce.h"
#include "common/env.h"
#include "core/average.h"
#include "core/backend_registry.h"
#include "dtrain/distributed.h"
#include "core/broken_group.h"
#include "common/logging.h"
#include "dtrain/store/prefix_store.h"

namespace dtrain::hierarchical {
namespace {

using Clock = std::chrono::steady_clock;

// Where each machine's ranks are, from every rank's node key.
std::vector<std::vector<int>> locate_ranks(Store& store, int rank, int size) {
  store.set(detail::cat("auto/node/", rank), shm::node_key());
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(store.get_string(detail::cat("auto/node/", r)));
  return shm::group_by_node(keys);
}


}  // namespace

namespace {

std::shared_ptr<ProcessGroup> create_cpu_group(std::shared_ptr<Store> store, int rank, int size,
                                               const GroupOptions& options,
                                               std::vector<std::vector<int>> nodes) {
  if (*env::get_int(env::kShmDisable, 0, 1) == 1) {
    DTRAIN_LOG_INFO("auto: group '", options.name(), "' on ", nodes.size(),
                    " machine(s): tcp for every rank (DTRAIN_SHM_DISABLE=1)");
    return std::make_shared<tcp_backend::TcpProcessGroup>(
        std::make_shared<PrefixStore>("auto", store), rank, size, options);
  }
  if (nodes.size() == 1) {
    DTRAIN_LOG_INFO("auto: group '", options.name(), "' is on one machine: shm");
    return std::make_shared<shm::ShmProcessGroup>(std::make_shared<PrefixStore>("auto", store),
                                                  rank, size, options);
  }
  DTRAIN_LOG_INFO("auto: group '", options.name(), "' spans ", nodes.size(),
                  " machines: shm within, tcp between");
  return std::make_shared<HierarchicalProcessGroup>(std::move(store), rank, size, options,
                                                    std::move(nodes));
}

}  // namespace

// Where libtorch has CUDA, CUDA tensors are routed to nccl or staged
// through host memory (device_routing/routing_group.h); elsewhere the CPU
// group is the whole story.
std::shared_ptr<ProcessGroup> create_auto_group(std::shared_ptr<Store> store, int rank, int size,
                                                const GroupOptions& options) {
  auto nodes = locate_ranks(*store, rank, size);
  int ranks_here = 0;
  for (const auto& node : nodes)
    if (std::find(node.begin(), node.end(), rank) != node.end()) ranks_here = static_cast<int>(node.size());
  auto cpu = create_cpu_group(store, rank, size, options, std::move(nodes));
  if (!at::globalContext().hasCUDA()) return cpu;
  return device_routing::route_by_device(std::move(cpu), std::move(store), ranks_here, options);
}

HierarchicalProcessGroup::HierarchicalProcessGroup(std::shared_ptr<Store> store, int rank,
                                                   int size, GroupOptions options,
                                                   std::vector<std::vector<int>> nodes)
    : ProcessGroup(rank, size, std::move(options)), nodes_(std::move(nodes)) {
  std::vector<int> leaders;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    leaders.push_back(nodes_[i].front());
    if (std::find(nodes_[i].begin(), nodes_[i].end(), rank) != nodes_[i].end())
      node_ = static_cast<int>(i);
  }
  const auto& mine = nodes_[node_];
  auto global = [&](const std::vector<int>& ranks) {
    std::vector<int> out;
    for (int r : ranks) out.push_back(global_ranks()[r]);
    return out;
  };
  auto sub = [&](const std::string& suffix, const std::vector<int>& ranks) {
    return GroupOptions(this->options())
        .name(name() + "/" + suffix)
        .global_ranks(global(ranks))
        .check_collectives(false);
  };
  // Creation order cannot deadlock: each group waits only for its members,
  // and every member reaches it without waiting on a later one.
  const int local_rank = static_cast<int>(std::find(mine.begin(), mine.end(), rank) - mine.begin());
  local_ = std::make_shared<shm::ShmProcessGroup>(
      std::make_shared<PrefixStore>(detail::cat("auto/local", node_), store), local_rank,
      static_cast<int>(mine.size()), sub(detail::cat("local", node_), mine));
  if (local_rank == 0)
    leaders_ = std::make_shared<tcp_backend::TcpProcessGroup>(
        std::make_shared<PrefixStore>("auto/leaders", store), node_,
        static_cast<int>(nodes_.size()), sub("leaders", leaders));
  std::vector<int> everyone(size);
  for (int r = 0; r < size; ++r) everyone[r] = r;
  all_ = std::make_shared<tcp_backend::TcpProcessGroup>(
      std::make_shared<PrefixStore>("auto/all", std::move(store)), rank, size,
      sub("all", everyone));
}

HierarchicalProcessGroup::~HierarchicalProcessGroup() = default;

std::string HierarchicalProcessGroup::backend_name() const {
  return detail::cat("auto (shm within ", nodes_.size(), " machines, tcp between)");
}

// The executor keeps the group's fate (see serial_executor.h): a timeout or
// transport error in any sub-group breaks this group, and every later call
// fails at once naming it. The sub-groups break only themselves; without
// this, a call that touches a sub-group still intact (the local shm group
// of a rank whose leader failed, or the tcp group over all ranks after the
// leaders' group failed) would wait out its whole timeout for ranks that
// have dropped out of step.
WorkPtr HierarchicalProcessGroup::enqueue(
    const Call& call, std::function<void(const std::function<Timeout()>&)> body) {
  auto work = std::make_shared<Work>(call.description);
  steps_.submit(work, [call, body = std::move(body)] {
    const auto deadline = Clock::now() + call.timeout;
    auto left = [deadline, call]() -> Timeout {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (ms.count() <= 0) throw TimeoutError(call.description + " timed out");
      return ms;
    };
    body(left);
  });
  return work;
}

// A Work already failed with broken_group_error when the group is broken.
WorkPtr HierarchicalProcessGroup::refuse_if_broken(const Call& call) const {
  auto first = steps_.error();
  if (!first) return nullptr;
  auto work = std::make_shared<Work>(call.description);
  work->finish(broken_group_error(call.description, first));
  return work;
}

WorkPtr HierarchicalProcessGroup::do_all_reduce(const Call& call, at::Tensor tensor,
                                                ReduceOp op) {
  return enqueue(call, [this, tensor, op](const auto& left) mutable {
    // AVG: sum everywhere, divide once at the end (as one flat group would).
    const auto combine = op == ReduceOp::AVG ? ReduceOp::SUM : op;
    local_->reduce(tensor, 0, combine, left())->wait();
    if (leaders_) leaders_->all_reduce(tensor, combine, left())->wait();
    local_->broadcast(tensor, 0, left())->wait();
    if (op == ReduceOp::AVG) divide_for_average(tensor, size());
  });
}

WorkPtr HierarchicalProcessGroup::do_broadcast(const Call& call, at::Tensor tensor, int root) {
  return enqueue(call, [this, tensor, root](const auto& left) {
    int root_node = 0, root_local = 0;
    for (size_t i = 0; i < nodes_.size(); ++i) {
      auto it = std::find(nodes_[i].begin(), nodes_[i].end(), root);
      if (it != nodes_[i].end()) {
        root_node = static_cast<int>(i);
        root_local = static_cast<int>(it - nodes_[i].begin());
      }
    }
    if (node_ == root_node) local_->broadcast(tensor, root_local, left())->wait();
    if (leaders_) leaders_->broadcast(tensor, root_node, left())->wait();
    if (node_ != root_node) local_->broadcast(tensor, 0, left())->wait();
  });
}

WorkPtr HierarchicalProcessGroup::do_barrier(const Call& call) {
  return enqueue(call, [this](const auto& left) {
    local_->barrier(left())->wait();
    if (leaders_) leaders_->barrier(left())->wait();
    local_->barrier(left())->wait();
  });
}

// Delegated to the tcp group over all ranks, still in this group's order.
WorkPtr HierarchicalProcessGroup::do_monitored_barrier(const Call& call, bool wait_all_ranks) {
  return enqueue(call, [this, timeout = call.timeout, wait_all_ranks](const auto&) {
    all_->monitored_barrier(timeout, wait_all_ranks)->wait();
  });
}

WorkPtr HierarchicalProcessGroup::do_reduce(const Call& call, at::Tensor tensor, int root,
                                            ReduceOp op) {
  return enqueue(call, [this, tensor, root, op](const auto& left) {
    all_->reduce(tensor, root, op, left())->wait();
  });
}

WorkPtr HierarchicalProcessGroup::do_all_gather(const Call& call, std::vector<at::Tensor> outputs,
                                                at::Tensor input) {
  return enqueue(call, [this, outputs, input](const auto& left) {
    all_->all_gather(outputs, input, left())->wait();
  });
}

WorkPtr HierarchicalProcessGroup::do_gather(const Call& call, std::vector<at::Tensor> outputs,
                                            at::Tensor input, int root) {
  return enqueue(call, [this, outputs, input, root](const auto& left) {
    all_->gather(outputs, input, root, left())->wait();
  });
}

WorkPtr HierarchicalProcessGroup::do_scatter(const Call& call, at::Tensor output,
                                             std::vector<at::Tensor> inputs, int root) {
  return enqueue(call, [this, output, inputs, root](const auto& left) {
    all_->scatter(output, inputs, root, left())->wait();
  });
}

WorkPtr HierarchicalProcessGroup::do_reduce_scatter(const Call& call, at::Tensor output,
                                                    std::vector<at::Tensor> inputs, ReduceOp op) {
  return enqueue(call, [this, output, inputs, op](const auto& left) {
    all_->reduce_scatter(output, inputs, op, left())->wait();
  });
}

WorkPtr HierarchicalProcessGroup::do_all_to_all(const Call& call, std::vector<at::Tensor> outputs,
                                                std::vector<at::Tensor> inputs) {
  return enqueue(call, [this, outputs, inputs](const auto& left) {
    all_->all_to_all(outputs, inputs, left())->wait();
  });
}

// Point to point is posted at once (never queued behind a collective).
WorkPtr HierarchicalProcessGroup::do_send(const Call& call, at::Tensor tensor, int dst, int tag) {
  if (auto refused = refuse_if_broken(call)) return refused;
  return all_->send(std::move(tensor), dst, tag, call.timeout);
}

WorkPtr HierarchicalProcessGroup::do_recv(const Call& call, at::Tensor tensor, int src, int tag) {
  if (auto refused = refuse_if_broken(call)) return refused;
  return all_->recv(std::move(tensor), src, tag, call.timeout);
}

DTRAIN_REGISTER_BACKEND(auto, register_backend("auto", create_auto_group))

}  // namespace dtrain::hierarchical
