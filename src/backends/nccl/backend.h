#pragma once

// Backend "nccl": every collective of the core on CUDA tensors through NCCL,
// with PyTorch's ProcessGroupNCCL semantics (the device part of the Work
// contract, dtrain/work.h):
//  - each operation runs on the group's own CUDA stream, after waiting (on
//    the device) for the issuing thread's current stream, so it sees tensors
//    that kernels queued before it produce;
//  - wait() makes the caller's current stream wait for the operation's end
//    event; Work::synchronize() blocks the host; barrier() blocks the host;
//  - the group holds the tensors of every operation until its end event has
//    completed (a watchdog thread polls the events), so dropping a handle or
//    a tensor early is safe.
// The group's device: InitOptions::device_id when given, else LOCAL_RANK
// modulo the number of GPUs when LOCAL_RANK is set (dtrain-run, torchrun),
// else the creating thread's current CUDA device. Every tensor must be on it.
//
// Timeouts: the communicator is created non-blocking, so a rank that never
// joins is a TimeoutError on the ranks that did; an operation that has not
// finished on the device within its timeout (a stopped or dead peer) makes
// the watchdog abort the communicator (ncclCommAbort: NCCL's kernels
// return), fail that work and every later one with TimeoutError, and break
// the group. NCCL's asynchronous errors (ncclCommGetAsyncError) do the same
// with NetworkError.
//
// Point to point: send and recv run on the group's stream in issue order,
// matched per peer in order as NCCL matches them, so two ranks that both
// send to each other first must post one of the receives first (NCCL's
// rule; tags are accepted and ignored, as in PyTorch). recv from kAnySource
// and monitored_barrier are not available on nccl (InvalidArgument saying
// so), as in PyTorch; use a tcp group for them.
//
// Needs a CUDA-enabled libtorch (c10_cuda) for the caller's current stream;
// a build against a CPU libtorch still compiles the backend and refuses to
// create a group with BackendUnavailable, naming CUDA's error first when
// there is no usable GPU.

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "core/failure_state.h"
#include "dtrain/backend.h"
#include "dtrain/backend_hooks.h"
#include "dtrain/store/store.h"

namespace dtrain::nccl_backend {

class Communicator;
class Stream;
struct InFlight;

// How launch() hands out an operation's Work.
struct Launch {
  bool host_blocking = false;  // wait() blocks the host (barrier)
  int source_rank = -1;        // a receive's peer, for Work::source_rank()
};

class NcclBackend final : public Backend {
 public:
  NcclBackend(std::shared_ptr<Store> store, int rank, int size, GroupOptions options);
  ~NcclBackend() override;

  std::string backend_name() const override { return "nccl"; }
  bool supports(c10::DeviceType type) const override { return type == c10::DeviceType::CUDA; }
  c10::Device control_device() const override;
  // ncclAvg is for floating types; the front door sums integers and divides.
  bool averages(c10::ScalarType dtype) const override;
  // Breaks the group as a timeout does (NCCL's communicator aborted).
  void abort(std::exception_ptr error) override;

 protected:
  DTRAIN_PROCESS_GROUP_HOOKS
  WorkPtr do_all_gather_into_tensor(const Call& call, at::Tensor output, at::Tensor input) override;
  WorkPtr do_reduce_scatter_tensor(const Call& call, at::Tensor output, at::Tensor input,
                                   ReduceOp op) override;
  // batch_isend_irecv: one NCCL group call, one work for the whole batch.
  std::vector<WorkPtr> post_batch(const std::vector<Call>& calls, std::vector<Op> ops) override;

 private:
  // Issues one operation: the group's stream waits for the caller's current
  // stream, `body` queues NCCL calls (and ATen ops) on it, an end event is
  // recorded, and the watchdog holds `tensors` until that event completes.
  WorkPtr launch(const Call& call, std::vector<at::Tensor> tensors,
                 const std::function<void()>& body, Launch how = {});
  // NCCL's group calls around `body`, settled like any non-blocking call.
  void grouped(const Call& call, const std::function<void()>& body);
  // Settles a non-blocking NCCL call's status under the call's deadline.
  void settle(const Call& call, int status, const char* what);
  void check_device(const Call& call, const at::Tensor& t) const;
  // `list` and `one`, each checked with check_device: the tensors to hold.
  std::vector<at::Tensor> checked(const Call& call, std::vector<at::Tensor> list,
                                  const at::Tensor& one) const;
  // One grouped ncclSend / ncclRecv (type: an ncclDataType_t), skipped when empty.
  void send_to(const at::Tensor& t, int peer, int type);
  void recv_from(const at::Tensor& t, int peer, int type);
  // gather (to_root: each rank's `own` into the root's blocks) or scatter
  // (the root's blocks into each rank's `own`), as one NCCL group.
  WorkPtr rooted(const Call& call, std::vector<at::Tensor> blocks, at::Tensor own, int root,
                 bool to_root);
  void watch();
  // Breaks the group after a timeout or an NCCL/CUDA error (see the .cpp).
  void break_group(std::exception_ptr error);

  int device_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<Stream> stream_;
  std::mutex issue_mutex_;  // one operation queued on the stream at a time

  std::mutex watch_mutex_;
  std::condition_variable watch_cv_;
  std::deque<std::shared_ptr<InFlight>> in_flight_;
  // Every failure here breaks the group (an argument is refused before
  // anything is queued, on the caller's thread).
  FailureState failures_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace dtrain::nccl_backend
