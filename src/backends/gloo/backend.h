#pragma once

// Backend "gloo": collectives on CPU tensors over Gloo's TCP transport.
// Works between machines: each rank listens on the address given in
// GroupOptions::local_address (or DTRAIN_SOCKET_IFNAME's address) and
// publishes it through the store; Gloo then builds a full mesh of TCP pairs.
//
// Collectives run in issue order on the group's executor thread, each under
// its own timeout (Gloo's setTimeout). Point-to-point operations are posted
// at once on the caller's thread and awaited on a second thread, so isend /
// irecv in any order never deadlock. After a transport failure the group is
// broken: later calls fail fast; destroy it and create a new one.

#include <memory>

#include "core/backend_hooks.h"
#include "core/serial_executor.h"
#include "dtrain/process_group.h"

namespace gloo {
class Context;
namespace transport {
class Device;
}
}  // namespace gloo

namespace dtrain::gloo_backend {

class GlooProcessGroup final : public ProcessGroup {
 public:
  GlooProcessGroup(std::shared_ptr<Store> store, int rank, int size, GroupOptions options);
  ~GlooProcessGroup() override;

  std::string backend_name() const override { return "gloo"; }
  bool supports(c10::DeviceType type) const override { return type == c10::DeviceType::CPU; }

 protected:
  DTRAIN_PROCESS_GROUP_HOOKS

 private:
  // Queues `body` on the collective thread; its exceptions become the
  // Work's failure, Gloo's translated into dtrain's types.
  WorkPtr enqueue(const Call& call, std::function<void()> body);
  void all_reduce_now(const Call& call, at::Tensor& flat, ReduceOp op);
  WorkPtr post_p2p(const Call& call, at::Tensor tensor, int peer, int tag, bool is_send);

  std::shared_ptr<::gloo::transport::Device> device_;
  std::shared_ptr<::gloo::Context> context_;
  // Declared last: destroyed first, so queued work finishes while the
  // context is still alive.
  SerialExecutor p2p_waits_;
  SerialExecutor collectives_;
};

}  // namespace dtrain::gloo_backend
