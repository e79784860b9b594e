#include "backends/nccl/communicator.h"

#include <cstring>
#include <thread>
#include <vector>

#include "backends/nccl/cuda_api.h"
#include "common/enforce.h"
#include "dtrain/errors.h"

namespace dtrain::nccl_backend {

void check_nccl(ncclResult_t status, const char* call, ncclComm_t comm) {
  if (status == ncclSuccess) return;
  std::string last;
  if (const char* text = ncclGetLastError(comm)) last = text;
  throw NetworkError(detail::cat(call, ": ", ncclGetErrorString(status), " (ncclResult ",
                                 static_cast<int>(status), ")", last.empty() ? "" : ": ", last));
}

namespace {

ncclUniqueId exchange_id(Store& store, const std::string& key, int rank) {
  ncclUniqueId id;
  if (rank == 0) {
    check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    store.set(key, std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(&id),
                                        reinterpret_cast<const uint8_t*>(&id) + sizeof id));
    return id;
  }
  const auto bytes = store.get(key);
  if (bytes.size() != sizeof id)
    throw NetworkError(detail::cat("nccl: the unique id under store key '", key, "' has ",
                                   bytes.size(), " bytes, expected ", sizeof id,
                                   " (another program wrote that key?)"));
  std::memcpy(&id, bytes.data(), sizeof id);
  return id;
}

}  // namespace

Communicator::Communicator(Store& store, const std::string& key, int rank, int size, int device,
                           std::chrono::milliseconds timeout, const std::string& what)
    : device_(device) {
  const ncclUniqueId id = exchange_id(store, key, rank);
  DeviceScope scope(device_);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const auto deadline = Clock::now() + timeout;
  const ncclResult_t status = ncclCommInitRankConfig(&comm_, size, id, rank, &config);
  if (status != ncclSuccess && status != ncclInProgress) {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
    check_nccl(status, "ncclCommInitRankConfig");
  }
  settle(status, "ncclCommInitRankConfig", deadline,
         what + ": creating the NCCL communicator (have the other ranks created theirs?)");
}

Communicator::~Communicator() {
  if (!comm_) return;
  DeviceScope scope(device_);
  if (!aborted() && async_error() == ncclSuccess) {
    // A non-blocking communicator finalizes asynchronously; give it a
    // bounded while, then abort instead.
    ncclResult_t status = ncclCommFinalize(comm_);
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (status == ncclInProgress && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      status = async_error();
    }
    if (status == ncclSuccess) {
      ncclCommDestroy(comm_);
      return;
    }
  }
  abort();
}

void Communicator::settle(ncclResult_t status, const char* call, Clock::time_point deadline,
                          const std::string& what) {
  while (status == ncclInProgress) {
    if (Clock::now() >= deadline) {
      abort();
      throw TimeoutError(detail::cat(what, ": ", call, " did not complete in time; the NCCL "
                                     "communicator was aborted"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    status = async_error();
  }
  if (status != ncclSuccess) {
    abort();
    check_nccl(status, call, comm_);
  }
}

ncclResult_t Communicator::async_error() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_ || !comm_) return ncclInvalidUsage;
  ncclResult_t result = ncclSuccess;
  const ncclResult_t status = ncclCommGetAsyncError(comm_, &result);
  return status != ncclSuccess ? status : result;
}

void Communicator::abort() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_ || !comm_) return;
  aborted_ = true;
  ncclCommAbort(comm_);
}

bool Communicator::aborted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return aborted_;
}

}  // namespace dtrain::nccl_backend
