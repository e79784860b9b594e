#include "backends/shm/backend.h"

#include "backends/engine/group.h"
#include "common/enforce.h"
#include "common/env.h"
#include "core/backend_registry.h"
#include "dtrain/distributed.h"
#include "transport/shm/shm_transport.h"

namespace dtrain::shm_backend {
namespace {

std::unique_ptr<transport::Transport> connect(Store& store, int rank, int size,
                                              const GroupOptions& options) {
  transport::ShmOptions t;
  t.timeout = options.timeout();
  t.name = options.name();
  t.unexpected_bytes =
      static_cast<size_t>(*env::get_int(env::kTcpUnexpectedBytes, 65536, int64_t{1} << 50));
  t.slots = true;
  return transport::connect_shm(store, rank, size, t);
}

}  // namespace

std::shared_ptr<ProcessGroup> create_shm_group(std::shared_ptr<Store> store, int rank, int size,
                                               const GroupOptions& options) {
  if (*env::get_int(env::kShmDisable, 0, 1) == 1)
    throw BackendUnavailable(detail::cat(
        "shm: group '", options.name(), "' asks for shared memory, which DTRAIN_SHM_DISABLE=1 "
        "forbids; unset it, or use backend \"tcp\" (or \"auto\", which then uses tcp)"));
  return std::make_shared<engine_backend::EngineProcessGroup>(
      std::move(store), rank, size, options,
      engine_backend::EngineProcessGroup::Carrier{connect, "shm", nullptr});
}

DTRAIN_REGISTER_BACKEND(shm, register_backend("shm", create_shm_group))

}  // namespace dtrain::shm_backend
