#include "backends/auto/backend.h"

#include <ATen/ATen.h>

#include "backends/auto/routing_group.h"
#include "backends/engine/group.h"
#include "backends/shm/backend.h"
#include "backends/tcp/backend.h"
#include "common/enforce.h"
#include "common/env.h"
#include "common/logging.h"
#include "core/backend_registry.h"
#include "dtrain/distributed.h"
#include "dtrain/store/prefix_store.h"
#include "transport/connect.h"
#include "transport/topology.h"

namespace dtrain::auto_backend {
namespace {

// What the algorithms do with this topology, for DTRAIN_DEBUG=INFO.
std::string paths(const transport::Topology& t) {
  if (!t.uniform())
    return "all_reduce flat (hosts hold different numbers of ranks)";
  if (t.hosts.front().size() == 1) return "all_reduce flat (one rank per host)";
  return "all_reduce, all_gather and reduce_scatter above 64 KiB in two levels";
}

std::shared_ptr<ProcessGroup> create_cpu_group(std::shared_ptr<Store> store, int rank, int size,
                                               const GroupOptions& options,
                                               std::shared_ptr<const transport::Topology> topology) {
  if (*env::get_int(env::kShmDisable, 0, 1) == 1) {
    DTRAIN_LOG_INFO("auto: group '", options.name(), "' on ", topology->describe(),
                    ": tcp for every rank (DTRAIN_SHM_DISABLE=1)");
    return tcp_backend::create_tcp_group(store, rank, size, options);
  }
  if (topology->hosts.size() == 1) {
    DTRAIN_LOG_INFO("auto: group '", options.name(), "' is on one host: shm");
    return shm_backend::create_shm_group(store, rank, size, options);
  }
  DTRAIN_LOG_INFO("auto: group '", options.name(), "' spans ", topology->describe(),
                  ": shared-memory rings within a host, tcp between; ", paths(*topology));
  auto connect = [topology](Store& s, int r, int, const GroupOptions& o) {
    auto t = tcp_backend::tcp_options(o);
    return transport::connect_topology(s, r, *topology, t);
  };
  const auto name =
      detail::cat("auto (shm within ", topology->hosts.size(), " machines, tcp between)");
  return std::make_shared<engine_backend::EngineProcessGroup>(
      store, rank, size, options,
      engine_backend::EngineProcessGroup::Carrier{connect, name, topology});
}

}  // namespace

std::shared_ptr<ProcessGroup> create_auto_group(std::shared_ptr<Store> store, int rank, int size,
                                                const GroupOptions& options) {
  auto scoped = std::make_shared<PrefixStore>("auto", std::move(store));
  auto topology = std::make_shared<const transport::Topology>(
      transport::discover_topology(*scoped, rank, size));
  const int ranks_here =
      static_cast<int>(topology->hosts[topology->host_of[rank]].size());
  auto cpu = create_cpu_group(scoped, rank, size, options, topology);
  if (!at::globalContext().hasCUDA() && !device_routing::thread_routing_forced()) return cpu;
  return device_routing::route_by_device(std::move(cpu), std::move(scoped), ranks_here, options);
}

DTRAIN_REGISTER_BACKEND(auto, register_backend("auto", create_auto_group))

}  // namespace dtrain::auto_backend
