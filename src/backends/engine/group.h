#pragma once

// The process group of the transport engine (transport/engine/engine.h),
// which backends "tcp" (and its alias "gloo"), "auto" across machines, and
// "shm"'s send/recv run on, each over its own transport (a Carrier): every
// collective on CPU tensors through the algorithms written over the
// transport (algorithms/). No gloo inside.
//
// Collectives run in issue order on the group's executor thread, each under
// its own deadline. Point-to-point operations are posted at once on the
// caller's thread and each completes on its own, whatever the order they
// were posted in (a second thread finishes their Works), so isend / irecv in
// any order never deadlock. The first failure (a timeout, a peer that closed or
// sent garbage, mismatched sizes) breaks the group: every later call fails
// at once with that first error; destroy the group and create a new one.

#include <functional>
#include <memory>

#include "dtrain/backend_hooks.h"
#include "core/completion_watcher.h"
#include "core/serial_executor.h"
#include "dtrain/process_group.h"
#include "transport/topology.h"
#include "transport/transport.h"

namespace dtrain::algorithms {
class Scratch;
struct Context;
enum class AllReduceAlgo;
namespace slots {
struct Call;
}
}

namespace dtrain::engine_backend {

class EngineProcessGroup final : public ProcessGroup {
 public:
  // Builds the group's transport (called only when size > 1).
  using Connect = std::function<std::unique_ptr<transport::Transport>(
      Store& store, int rank, int size, const GroupOptions& options)>;
  // The transport a backend runs the engine over: tcp's sockets, shm's
  // rings for its send/recv, auto's rings inside hosts and TCP across.
  struct Carrier {
    Connect connect;
    std::string backend_name;
    // Where the ranks are, for the algorithms; null: a flat group.
    std::shared_ptr<const transport::Topology> topology;
  };

  EngineProcessGroup(std::shared_ptr<Store> store, int rank, int size, GroupOptions options,
                     Carrier carrier);
  ~EngineProcessGroup() override;

  std::string backend_name() const override { return backend_name_; }
  bool supports(c10::DeviceType type) const override { return type == c10::DeviceType::CPU; }

 protected:
  DTRAIN_PROCESS_GROUP_HOOKS
  WorkPtr do_all_gather_into_tensor(const Call& call, at::Tensor output,
                                    at::Tensor input) override;
  WorkPtr do_reduce_scatter_tensor(const Call& call, at::Tensor output, at::Tensor input,
                                   ReduceOp op) override;

 private:
  // Queues `body` on the collective thread; a broken group fails the Work
  // at once, naming the first error.
  WorkPtr enqueue(const Call& call, std::function<void(const algorithms::Context&)> body);
  // The same for a collective over the transport's shared slots (shm's
  // copy-free path; null when the transport has none).
  shm::Slots* slots() const { return transport_ ? transport_->shared_slots() : nullptr; }
  WorkPtr enqueue_slots(const Call& call,
                        std::function<void(const algorithms::slots::Call&)> body);
  WorkPtr post_p2p(const Call& call, at::Tensor tensor, int peer, int tag, bool is_send);

  std::string backend_name_;
  std::shared_ptr<const transport::Topology> topology_;
  algorithms::AllReduceAlgo algo_{};  // DTRAIN_ALGO
  std::unique_ptr<transport::Transport> transport_;
  // Used only on the collectives thread (see algorithms::Scratch).
  std::unique_ptr<algorithms::Scratch> scratch_, copy_, rows_;
  // Declared last: destroyed first, so queued work finishes while the
  // transport is still alive.
  std::shared_ptr<FailureState> failures_;  // shared with collectives_
  CompletionWatcher p2p_;
  SerialExecutor collectives_;
};

}  // namespace dtrain::engine_backend
