#include "backends/tcp/backend.h"

#include "backends/fabric/backend.h"
#include "common/logging.h"
#include "core/backend_registry.h"
#include "dtrain/distributed.h"

namespace dtrain::tcp_backend {

std::shared_ptr<ProcessGroup> create_tcp_group(std::shared_ptr<Store> store, int rank, int size,
                                               const GroupOptions& options) {
  auto group = fabric_backend::cpu_group(
      rank, size, options,
      fabric_backend::make_backend(std::move(store), rank, size, options, "tcp",
                                   transport::Topology::host_per_rank(size),
                                   /*host_slots=*/false, "tcp"));
  DTRAIN_LOG_INFO("tcp: group '", options.name(), "' connected, rank ", rank, "/", size, " via ",
                  options.local_address().empty() ? "127.0.0.1" : options.local_address());
  return group;
}

// "gloo" is PyTorch's name for its CPU backend: code written for
// torch.distributed gets dtrain's tcp backend under it.
DTRAIN_REGISTER_BACKEND(tcp, {
  register_backend("tcp", create_tcp_group);
  register_backend("gloo", create_tcp_group);
})

}  // namespace dtrain::tcp_backend
