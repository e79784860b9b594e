#pragma once

// What a backend registers besides its factory (dtrain/distributed.h's
// register_backend): backends register themselves from their own folder
// (a static registrar in backend.cpp), so core/ includes no backend header.

#include <functional>
#include <string>
#include <utility>

#include "dtrain/backend.h"
#include "dtrain/store/store.h"

namespace dtrain::detail {

// A backend whose processes already know their rank and world size without
// a store (mpi: from mpirun) registers how to ask; init_process_group with
// that backend and no store uses it instead of a rendezvous.
using OwnWorld = std::function<std::pair<int, int>()>;
void register_own_world(const std::string& backend, OwnWorld own_world);
// Null when the backend has none (or is not built).
OwnWorld own_world(const std::string& backend);

// The backend registered as `name` with its device types (loading its
// plug-in, if it has one): for backends that a group composes with others
// (auto's CUDA tensors to nccl). BackendUnavailable as create_process_group,
// also for a name registered as a factory of whole groups.
BackendPtr create_backend(const std::string& name, std::shared_ptr<Store> store, int rank,
                          int size, const GroupOptions& options);

// "" when `backend` can be created here (its plug-in, if it has one, is
// loaded by this call); else why not, as create_process_group would say.
std::string backend_unavailable_reason(const std::string& backend);

}  // namespace dtrain::detail

// In a backend's .cpp: runs `statement` (register_backend calls) once, when
// the library is loaded.
#define DTRAIN_REGISTER_BACKEND(tag, statement)                  \
  namespace {                                                     \
  [[maybe_unused]] const bool dtrain_registered_##tag = [] {      \
    statement;                                                    \
    return true;                                                  \
  }();                                                            \
  }
