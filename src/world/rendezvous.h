#pragma once

// Turns InitOptions plus the environment into what a group needs: a store
// shared by all ranks, this rank, the world size and the address peers will
// reach us at. All inputs are validated before any connection is made.

#include <chrono>
#include <memory>
#include <string>

#include "dtrain/distributed.h"

namespace dtrain {

struct Rendezvous {
  std::shared_ptr<Store> store;  // already scoped to this job attempt
  int rank = -1;
  int world_size = -1;
  std::chrono::milliseconds timeout{0};
  std::string local_address;
};

// InitOptions().timeout, else DTRAIN_TIMEOUT.
std::chrono::milliseconds resolve_timeout(const InitOptions& options);
// Resolves rank/world/timeout from options and environment (no I/O).
Rendezvous resolve_rendezvous_inputs(const InitOptions& options);
// Connects the store and waits until every rank has joined.
Rendezvous rendezvous(const InitOptions& options);

}  // namespace dtrain
