#pragma once

// Backend "mpi": collectives on CPU tensors through the MPI library the job
// was started with (mpirun), as MPI-3 non-blocking calls behind the Work
// contract: each call is posted on the caller's thread, in issue order, and
// completed (MPI_Test, under the operation's timeout) on the group's thread.
// Point-to-point operations each complete on their own (a second thread
// MPI_Tests them all), whatever the order they were posted in, so isend /
// irecv in any order never deadlock.
//
// After a timeout the group is broken (later calls fail at once, see
// core/failure_state.h). A timed-out send or recv is cancelled (MPI_Cancel;
// Open MPI cancels receives only); a collective cannot be. What MPI may
// still read or write for an operation not cancelled — its tensors and
// staging buffers — is kept alive by a process-wide list of requests in
// flight until MPI_Test says MPI is done with them (reaped at every later
// call and when a group is destroyed), or until the process exits: memory
// MPI writes into is never freed under it. A collective's tensors may still
// change after its TimeoutError.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/backend_hooks.h"
#include "core/completion_watcher.h"
#include "core/failure_state.h"
#include "core/serial_executor.h"
#include "dtrain/backend.h"
#include "dtrain/process_group.h"

namespace dtrain::mpi_backend {

class MpiBackend final : public Backend {
 public:
  // The communicator holds options.global_ranks() of MPI_COMM_WORLD (all of
  // it when empty); `rank` must be this process's rank in it.
  MpiBackend(int rank, int size, GroupOptions options);
  ~MpiBackend() override;

  std::string backend_name() const override { return "mpi"; }
  int max_tag() const override;
  bool supports(c10::DeviceType type) const override { return type == c10::DeviceType::CPU; }

 protected:
  DTRAIN_PROCESS_GROUP_HOOKS

 private:
  struct Comm;
  struct Posted;  // the MPI request of one operation and the buffers it uses
  // Runs `post` now (it starts the MPI operation and fills the request),
  // completes it on `executor`, then runs `after` (copies out).
  // `buffers` are the tensors MPI reads or writes until the request is done.
  WorkPtr launch(const Call& call, SerialExecutor& executor, std::vector<at::Tensor> buffers,
                 const std::function<void(Posted&)>& post, std::function<void()> after = {});
  // Posts a send or recv now; its Work finishes when MPI says it is done
  // (p2p_), not behind earlier ones.
  WorkPtr launch_p2p(const Call& call, at::Tensor tensor,
                     const std::function<void(Posted&)>& post);
  // Polls the request until MPI is done with it; at the deadline expire()s.
  void complete(const Call& call, const std::shared_ptr<Posted>& posted);
  // One MPI_Test: true once MPI is done with the request.
  bool test(const Call& call, Posted& posted);
  // The deadline passed: cancels what can be, hands the rest to the
  // requests in flight and throws TimeoutError (returns when the request
  // completed after all).
  void expire(const Call& call, const std::shared_ptr<Posted>& posted);
  // The group is destroyed with the request pending: cancels what can be,
  // hands the rest to the requests in flight.
  static void abandon(Posted& posted);
  void mark_broken(std::exception_ptr error);
  void run_monitored_barrier(const Call& call, bool wait_all_ranks);
  // User tags stay below MPI_TAG_UB, which monitored_barrier uses.
  void check_tag(const Call& call, int tag) const;

  std::unique_ptr<Comm> comm_;
  std::shared_ptr<FailureState> failures_ = std::make_shared<FailureState>();
  CompletionWatcher p2p_;
  SerialExecutor collectives_{failures_};  // last: drained first on destruction
};

// {rank, size} of this process in MPI_COMM_WORLD (initializes MPI).
std::pair<int, int> mpi_world();

// MPI_Ialltoallv's per-peer counts and displacements (in elements), which
// MPI takes as int: computed in 64 bits, and InvalidArgument naming `what`
// (the call) when a count or a displacement exceeds INT_MAX. MPI-4's
// large-count calls would lift this; Debian 12's Open MPI 4.1 has none.
struct PeerCounts {
  std::vector<int> counts, displacements;
  int64_t total = 0;
};
PeerCounts peer_counts(const std::vector<int64_t>& numels, const std::string& what);

// Requests given up on after a timeout that MPI has not finished with yet
// (tests each first; MPI progresses meanwhile).
size_t requests_in_flight();

}  // namespace dtrain::mpi_backend
