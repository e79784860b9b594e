#pragma once

// The backend of "tcp" (and its alias "gloo"), "shm" and "auto"'s CPU
// tensors: one fabric (transport/fabric.h) over the group's topology, every
// collective through the algorithms (algorithms/collectives.h), which pick
// their own path: the host's shared memory, or the transport. The three
// are three topologies of this one backend. No gloo inside.
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

#include "core/completion_watcher.h"
#include "core/serial_executor.h"
#include "dtrain/backend.h"
#include "dtrain/backend_hooks.h"
#include "dtrain/process_group.h"
#include "transport/fabric.h"
#include "transport/topology.h"

namespace dtrain::algorithms {
class Scratch;
struct Context;
enum class AllReduceAlgo;
}

namespace dtrain::fabric_backend {

class FabricBackend final : public Backend {
 public:
  // What a backend makes of this group: where its ranks are (each its own
  // host on tcp, one host on shm, the discovered hosts on auto) and how the
  // fabric joins them.
  struct Setup {
    std::string backend_name;
    std::shared_ptr<const transport::Topology> topology;
    transport::FabricOptions fabric;
  };

  FabricBackend(std::shared_ptr<Store> store, int rank, int size, GroupOptions options,
                Setup setup);
  ~FabricBackend() override;

  std::string backend_name() const override { return backend_name_; }
  bool supports(c10::DeviceType type) const override { return type == c10::DeviceType::CPU; }
  // Every reduction divides AVG itself (in the reduction, in shared memory).
  bool averages(c10::ScalarType) const override { return true; }
  // Breaks the group: the transport fails what is in flight and closes its
  // connections (the peers see them close).
  void abort(std::exception_ptr error) override;

 protected:
  DTRAIN_PROCESS_GROUP_HOOKS

 private:
  // Queues `body` on the collective thread (a group of one rank runs it
  // at once); a broken group fails the Work at once, naming the first error.
  // Queues `body` on the collectives thread. An operation of up to
  // kWaiterRunsBytes (`bytes`: what this rank's tensors hold) runs on the
  // thread that waits for it when it is next (core/serial_executor.h): on 2
  // cores that halves a 4 KiB all_reduce's time on shm and tcp and gains up
  // to 512 KiB, but 3 tcp ranks lost 5-15% at 1-2 MiB (the caller's
  // thread, busier than the collectives thread, is woken later by the I/O
  // threads when the cores are oversubscribed).
  static constexpr size_t kWaiterRunsBytes = size_t{512} << 10;
  WorkPtr enqueue(const Call& call, size_t bytes,
                  std::function<void(const algorithms::Context&)> body);
  WorkPtr post_p2p(const Call& call, at::Tensor tensor, int peer, int tag, bool is_send);

  std::string backend_name_;
  std::shared_ptr<const transport::Topology> topology_;
  algorithms::AllReduceAlgo algo_{};  // DTRAIN_ALGO
  transport::Fabric fabric_;
  // Used only on the collectives thread (see algorithms::Scratch).
  std::unique_ptr<algorithms::Scratch> scratch_, copy_, rows_;
  // Declared last: destroyed first, so queued work finishes while the
  // transport is still alive.
  std::shared_ptr<FailureState> failures_;  // shared with collectives_
  CompletionWatcher p2p_;
  SerialExecutor collectives_;
};

// The backend `backend_name` over `topology`: the fabric's options from
// `options` and the environment (DTRAIN_TCP_STREAMS,
// DTRAIN_TCP_UNEXPECTED_BYTES, the job token); `host_slots`: map the shared
// memory of hosts with several ranks; `label`: the first word of the
// transport's messages.
BackendPtr make_backend(std::shared_ptr<Store> store, int rank, int size,
                        const GroupOptions& options, std::string backend_name,
                        transport::Topology topology, bool host_slots, std::string label);

// A group (process_group.h) of that backend for CPU tensors.
std::shared_ptr<ProcessGroup> cpu_group(int rank, int size, const GroupOptions& options,
                                        BackendPtr backend);

}  // namespace dtrain::fabric_backend
