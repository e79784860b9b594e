#pragma once

// Backend "tcp" (also registered as "gloo", PyTorch's name for its CPU
// backend, so code written for torch.distributed keeps working): the
// transport engine's group (backends/engine/group.h) over dtrain's own TCP
// transport (transport/tcp/), between machines or on one.

#include <memory>

#include "dtrain/process_group.h"
#include "transport/tcp/transport.h"

namespace dtrain::tcp_backend {

// dtrain's TCP transport options, from the group's options and the
// environment (DTRAIN_TCP_STREAMS, DTRAIN_TCP_UNEXPECTED_BYTES, the token).
transport::TcpOptions tcp_options(const GroupOptions& options);

std::shared_ptr<ProcessGroup> create_tcp_group(std::shared_ptr<Store> store, int rank, int size,
                                               const GroupOptions& options);

}  // namespace dtrain::tcp_backend
