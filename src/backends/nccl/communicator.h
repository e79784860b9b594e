#pragma once

// One NCCL communicator: its unique id exchanged through the store, created
// non-blocking (ncclCommInitRankConfig with blocking = 0) so that every wait
// on it has a deadline, and aborted (ncclCommAbort) when a deadline passes
// or NCCL reports an asynchronous error, which makes NCCL's kernels on every
// stream of it return.

#include <nccl.h>

#include <chrono>
#include <mutex>
#include <string>

#include "dtrain/store/store.h"

namespace dtrain::nccl_backend {

// Throws NetworkError naming the call, NCCL's error string and its last
// error message (ncclGetLastError).
void check_nccl(ncclResult_t status, const char* call, ncclComm_t comm = nullptr);

class Communicator {
 public:
  using Clock = std::chrono::steady_clock;

  // Rank 0 makes the unique id and publishes it under `key`; the others read
  // it (the store's own timeout applies). Then every rank initializes its
  // part on `device`, failing with TimeoutError (naming `what`) when the
  // other ranks have not joined within `timeout`.
  Communicator(Store& store, const std::string& key, int rank, int size, int device,
               std::chrono::milliseconds timeout, const std::string& what);
  // Destroys the communicator (aborting it when it failed or was aborted).
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  ncclComm_t get() const { return comm_; }

  // After a non-blocking NCCL call that returned `status`: while it is
  // ncclInProgress, polls the communicator until NCCL has settled it or the
  // deadline passes (then aborts, TimeoutError naming `what`).
  void settle(ncclResult_t status, const char* call, Clock::time_point deadline,
              const std::string& what);

  // ncclSuccess, ncclInProgress, or the error NCCL found asynchronously.
  ncclResult_t async_error();

  // Makes every NCCL operation of the communicator return; idempotent.
  void abort();
  bool aborted() const;

 private:
  int device_;
  ncclComm_t comm_ = nullptr;
  mutable std::mutex mutex_;
  bool aborted_ = false;
};

}  // namespace dtrain::nccl_backend
