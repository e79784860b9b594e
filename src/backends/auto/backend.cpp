#include "backends/auto/backend.h"

#include <ATen/ATen.h>

#include "backends/auto/device_routing.h"
#include "backends/fabric/backend.h"
#include "common/enforce.h"
#include "common/env.h"
#include "common/logging.h"
#include "core/backend_registry.h"
#include "dtrain/distributed.h"
#include "dtrain/store/prefix_store.h"
#include "transport/topology.h"

namespace dtrain::auto_backend {
namespace {

// What the algorithms do with this topology, for DTRAIN_DEBUG=INFO.
std::string paths(const transport::Topology& t) {
  if (!t.uniform())
    return "all_reduce flat (hosts hold different numbers of ranks)";
  if (t.hosts.front().size() == 1) return "all_reduce flat (one rank per host)";
  return "all_reduce, all_gather and reduce_scatter above 64 KiB in two levels, their "
         "phases inside a host in its shared memory";
}

BackendPtr create_cpu_backend(std::shared_ptr<Store> store, int rank, int size,
                              const GroupOptions& options, const transport::Topology& topology) {
  using fabric_backend::make_backend;
  if (*env::get_int(env::kShmDisable, 0, 1) == 1) {
    DTRAIN_LOG_INFO("auto: group '", options.name(), "' on ", topology.describe(),
                    ": tcp for every rank (DTRAIN_SHM_DISABLE=1)");
    return make_backend(std::move(store), rank, size, options, "tcp",
                        transport::Topology::host_per_rank(size), /*host_slots=*/false, "tcp");
  }
  if (topology.hosts.size() == 1) {
    DTRAIN_LOG_INFO("auto: group '", options.name(), "' is on one host: shm");
    return make_backend(std::move(store), rank, size, options, "shm", topology,
                        /*host_slots=*/true, "shm");
  }
  DTRAIN_LOG_INFO("auto: group '", options.name(), "' spans ", topology.describe(),
                  ": shared-memory rings within a host, tcp between; ", paths(topology));
  const auto name =
      detail::cat("auto (shm within ", topology.hosts.size(), " machines, tcp between)");
  return make_backend(std::move(store), rank, size, options, name, topology,
                      /*host_slots=*/true, "auto");
}

}  // namespace

std::shared_ptr<ProcessGroup> create_auto_group(std::shared_ptr<Store> store, int rank, int size,
                                                const GroupOptions& options) {
  auto scoped = std::make_shared<PrefixStore>("auto", std::move(store));
  const auto topology = transport::discover_topology(*scoped, rank, size);
  const int ranks_here = static_cast<int>(topology.hosts[topology.host_of[rank]].size());
  auto cpu = create_cpu_backend(scoped, rank, size, options, topology);
  if (!at::globalContext().hasCUDA() && !device_routing::thread_routing_forced())
    return fabric_backend::cpu_group(rank, size, options, std::move(cpu));
  return device_routing::route_by_device(std::move(cpu), std::move(scoped), ranks_here, options);
}

DTRAIN_REGISTER_BACKEND(auto, register_backend("auto", create_auto_group))

}  // namespace dtrain::auto_backend
