#pragma once

// Backend "tcp" (also registered as "gloo", PyTorch's name for its CPU
// backend, so code written for torch.distributed keeps working): the
// fabric's group (backends/fabric/backend.h) over the topology where every
// rank is a host of its own, so every pair is joined by dtrain's TCP
// sockets (transport/tcp/), between machines or on one.

#include <memory>

#include "dtrain/process_group.h"

namespace dtrain::tcp_backend {

std::shared_ptr<ProcessGroup> create_tcp_group(std::shared_ptr<Store> store, int rank, int size,
                                               const GroupOptions& options);

}  // namespace dtrain::tcp_backend
