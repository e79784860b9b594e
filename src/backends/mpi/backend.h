#pragma once

// Backend "mpi": collectives on CPU tensors through the MPI library the job
// was started with (mpirun), as MPI-3 non-blocking calls behind the Work
// contract: each call is posted on the caller's thread, in issue order, and
// completed (MPI_Test, under the operation's timeout) on the group's thread.
// Point-to-point completes on a second thread, so isend/irecv in any order
// never deadlock. MPI cannot cancel a collective: after a timeout the group is
// broken and the job should end (mpirun then stops the other ranks).

#include <memory>

#include "core/backend_hooks.h"
#include "core/serial_executor.h"
#include "dtrain/process_group.h"

namespace dtrain::mpi_backend {

class MpiProcessGroup final : public ProcessGroup {
 public:
  // The communicator holds options.global_ranks() of MPI_COMM_WORLD (all of
  // it when empty); `rank` must be this process's rank in it.
  MpiProcessGroup(int rank, int size, GroupOptions options);
  ~MpiProcessGroup() override;

  std::string backend_name() const override { return "mpi"; }
  bool supports(c10::DeviceType type) const override { return type == c10::DeviceType::CPU; }

 protected:
  DTRAIN_PROCESS_GROUP_HOOKS

 private:
  struct Comm;
  struct Posted;  // the MPI request of one operation
  // Runs `post` now (it starts the MPI operation and fills the request),
  // completes it on `executor`, then runs `after` (copies out, AVG).
  WorkPtr launch(const Call& call, SerialExecutor& executor,
                 const std::function<void(Posted&)>& post, std::function<void()> after = {});

  std::unique_ptr<Comm> comm_;
  std::exception_ptr broken_;
  std::mutex broken_mutex_;
  SerialExecutor p2p_waits_;
  SerialExecutor collectives_;  // last: drained first on destruction
};

// {rank, size} of this process in MPI_COMM_WORLD (initializes MPI).
std::pair<int, int> mpi_world();

}  // namespace dtrain::mpi_backend
