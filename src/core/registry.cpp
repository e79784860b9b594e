// The backend registry: name -> factory. Backends a build lacks are
// registered as explanations, so asking for them says why, not "unknown".

#include <dlfcn.h>

#include <map>
#include <mutex>

#include "core/backend_registry.h"
#include "common/enforce.h"
#include "dtrain/distributed.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, BackendFactory> factories;
  std::map<std::string, std::string> missing;  // name -> why it is not built
  std::map<std::string, detail::OwnWorld> own_worlds;
};

Registry& registry() {
  // Backends add themselves as the library loads (DTRAIN_REGISTER_BACKEND in
  // their backend.cpp); the ones a build may lack leave an explanation here,
  // which their registration replaces.
  static Registry* r = [] {
    auto* reg = new Registry;
    reg->missing["nccl"] =
        "dtrain was built without the nccl backend (it needs CUDA's runtime and NCCL at build "
        "time: DTRAIN_WITH_NCCL=ON, CUDAToolkit_ROOT, NCCL_HOME)";
    reg->missing["mpi"] =
        "dtrain was built without MPI (install an MPI library, e.g. Debian's libopenmpi-dev, "
        "and rebuild)";
    return reg;
  }();
  return *r;
}

// Backends built as plug-ins, loaded the first time they are asked for:
// their libraries (CUDA's runtime, NCCL) are not what a CPU job should load.
// A plug-in registers itself as it loads (DTRAIN_REGISTER_BACKEND).
const std::map<std::string, std::string>& plugins() {
  static const std::map<std::string, std::string> files = {
#ifdef DTRAIN_NCCL_PLUGIN
      {"nccl", DTRAIN_NCCL_PLUGIN},
#endif
  };
  return files;
}

// The directory libdtrain was loaded from: plug-ins are installed beside it.
std::string library_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&library_directory), &info) == 0 || !info.dli_fname) return "";
  const std::string path = info.dli_fname;
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash + 1);
}

// Loads the plug-in of `backend`, once; returns why it could not be loaded
// (empty when it was, or when the backend has no plug-in).
std::string load_plugin(const std::string& backend) {
  auto it = plugins().find(backend);
  if (it == plugins().end()) return "";
  static std::mutex mutex;
  static std::map<std::string, std::string> outcome;
  std::lock_guard<std::mutex> lock(mutex);
  auto done = outcome.find(backend);
  if (done != outcome.end()) return done->second;
  const std::string path = library_directory() + it->second;
  std::string error;
  if (!dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) {
    const char* why = dlerror();
    error = detail::cat("its plug-in ", path, " could not be loaded: ", why ? why : "dlopen failed");
  }
  return outcome[backend] = error;
}

// Why `backend` has no factory (under the registry's lock): its plug-in
// failed to load, the build left it out, or no such backend; "" when it has one.
std::string why_unavailable(const Registry& r, const std::string& backend,
                            const std::string& plugin_error) {
  if (r.factories.count(backend)) return "";
  if (!plugin_error.empty()) return detail::cat(backend, ": ", plugin_error);
  auto why = r.missing.find(backend);
  if (why != r.missing.end()) return detail::cat(backend, ": ", why->second);
  return detail::cat("unknown backend '", backend, "'");
}

}  // namespace

void register_backend(const std::string& name, BackendFactory factory) {
  DTRAIN_CHECK_ARG(!name.empty() && factory, "register_backend: need a name and a factory");
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.factories[name] = std::move(factory);
  r.missing.erase(name);
}

namespace detail {

void register_own_world(const std::string& backend, OwnWorld own_world) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.own_worlds[backend] = std::move(own_world);
}

OwnWorld own_world(const std::string& backend) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.own_worlds.find(backend);
  return it == r.own_worlds.end() ? nullptr : it->second;
}

std::string backend_unavailable_reason(const std::string& backend) {
  const std::string plugin_error = load_plugin(backend);
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return why_unavailable(r, backend, plugin_error);
}

}  // namespace detail

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
  // Not under the registry's lock: the plug-in registers itself as it loads.
  const std::string plugin_error = load_plugin(backend);
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.factories.find(backend);
    if (it == r.factories.end()) {
      std::vector<std::string> names;
      for (const auto& [name, _] : r.factories) names.push_back(name);
      throw BackendUnavailable(detail::cat(why_unavailable(r, backend, plugin_error),
                                           "; available backends: ", detail::join(names)));
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
