#pragma once

// Client of the store that PyTorch's torchrun agent hosts on MASTER_PORT
// when it sets TORCHELASTIC_USE_AGENT_STORE=True. That server speaks c10d's
// TCPStore protocol, so this client is libtorch's own c10d::TCPStore — the
// only way to stay wire compatible with whichever torchrun the user has.

#include <chrono>
#include <memory>
#include <string>

#include "dtrain/store/store.h"

namespace dtrain {

std::shared_ptr<Store> connect_agent_store(const std::string& host, uint16_t port,
                                           std::chrono::milliseconds timeout);

}  // namespace dtrain
