#include "backends/shm/backend.h"

#include "backends/fabric/backend.h"
#include "common/enforce.h"
#include "common/env.h"
#include "core/backend_registry.h"
#include "dtrain/distributed.h"

namespace dtrain::shm_backend {

std::shared_ptr<ProcessGroup> create_shm_group(std::shared_ptr<Store> store, int rank, int size,
                                               const GroupOptions& options) {
  if (*env::get_int(env::kShmDisable, 0, 1) == 1)
    throw BackendUnavailable(detail::cat(
        "shm: group '", options.name(), "' asks for shared memory, which DTRAIN_SHM_DISABLE=1 "
        "forbids; unset it, or use backend \"tcp\" (or \"auto\", which then uses tcp)"));
  return fabric_backend::cpu_group(
      rank, size, options,
      fabric_backend::make_backend(std::move(store), rank, size, options, "shm",
                                   transport::Topology::one_host(size), /*host_slots=*/true,
                                   "shm"));
}

DTRAIN_REGISTER_BACKEND(shm, register_backend("shm", create_shm_group))

}  // namespace dtrain::shm_backend
