// The backend registry: name -> factory. Backends a build lacks are
// registered as explanations, so asking for them says why, not "unknown".

#include <map>
#include <mutex>

#include "backends/tcp/backend.h"
#include "backends/hierarchical/backend.h"
#include "backends/shm/backend.h"
#ifdef DTRAIN_WITH_MPI
#include "backends/mpi/backend.h"
#endif
#include "common/enforce.h"
#include "dtrain/distributed.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, BackendFactory> factories;
  std::map<std::string, std::string> missing;  // name -> why it is not built
};

Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry;
    // "gloo" is PyTorch's name for its CPU backend: code written for
    // torch.distributed gets dtrain's tcp backend under it.
    reg->factories["tcp"] = reg->factories["gloo"] =
        [](std::shared_ptr<Store> store, int rank, int size, const GroupOptions& options) {
          return std::make_shared<tcp_backend::TcpProcessGroup>(std::move(store), rank, size,
                                                                options);
        };
    reg->factories["shm"] = [](std::shared_ptr<Store> store, int rank, int size,
                               const GroupOptions& options) {
      return std::make_shared<shm::ShmProcessGroup>(std::move(store), rank, size, options);
    };
    reg->factories["auto"] = hierarchical::create_auto_group;
    // backends/nccl registers itself when it is built.
    reg->missing["nccl"] =
        "dtrain was built without the nccl backend (it needs CUDA's runtime and NCCL at build "
        "time: DTRAIN_WITH_NCCL=ON, CUDAToolkit_ROOT, NCCL_HOME)";
#ifdef DTRAIN_WITH_MPI
    reg->factories["mpi"] = [](std::shared_ptr<Store>, int rank, int size,
                               const GroupOptions& options) {
      return std::make_shared<mpi_backend::MpiProcessGroup>(rank, size, options);
    };
#else
    reg->missing["mpi"] =
        "dtrain was built without MPI (install an MPI library, e.g. Debian's libopenmpi-dev, "
        "and rebuild)";
#endif
    return reg;
  }();
  return *r;
}

}  // namespace

void register_backend(const std::string& name, BackendFactory factory) {
  DTRAIN_CHECK_ARG(!name.empty() && factory, "register_backend: need a name and a factory");
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.factories[name] = std::move(factory);
  r.missing.erase(name);
}

std::vector<std::string> available_backends() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> names;
  for (const auto& [name, _] : r.factories) names.push_back(name);
  return names;
}

std::shared_ptr<ProcessGroup> create_process_group(const std::string& backend,
                                                   std::shared_ptr<Store> store, int rank,
                                                   int size, const GroupOptions& options) {
  BackendFactory factory;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.factories.find(backend);
    if (it == r.factories.end()) {
      std::vector<std::string> names;
      for (const auto& [name, _] : r.factories) names.push_back(name);
      auto why = r.missing.find(backend);
      if (why != r.missing.end())
        throw BackendUnavailable(detail::cat(backend, ": ", why->second,
                                             "; available backends: ", detail::join(names)));
      throw BackendUnavailable(detail::cat("unknown backend '", backend,
                                           "'; available backends: ", detail::join(names)));
    }
    factory = it->second;
  }
  DTRAIN_CHECK_ARG(store, "create_process_group: store is null");
  DTRAIN_CHECK_ARG(size > 0, "create_process_group: size must be positive, got ", size);
  DTRAIN_CHECK_ARG(rank >= 0 && rank < size, "create_process_group: rank ", rank,
                   " is out of range for size ", size, " (expected 0..", size - 1, ")");
  return factory(std::move(store), rank, size, options);
}

}  // namespace dtrain
