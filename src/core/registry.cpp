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

// A registration: a backend and its devices, or (the older form) whole groups.
struct Entry {
  std::vector<c10::DeviceType> devices;
  MakeBackend make;
  BackendFactory groups;
};

struct Registry {
  std::mutex mutex;
  std::map<std::string, Entry> factories;
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

namespace {

void add(const std::string& name, Entry entry) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.factories[name] = std::move(entry);
  r.missing.erase(name);
}

// The registration of `backend` (loading its plug-in first), or
// BackendUnavailable naming why there is none.
Entry find(const std::string& backend) {
  // Not under the registry's lock: the plug-in registers itself as it loads.
  const std::string plugin_error = load_plugin(backend);
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.factories.find(backend);
  if (it != r.factories.end()) return it->second;
  std::vector<std::string> names;
  for (const auto& [name, _] : r.factories) names.push_back(name);
  throw BackendUnavailable(detail::cat(why_unavailable(r, backend, plugin_error),
                                       "; available backends: ", detail::join(names)));
}

void check_group(const char* what, const std::shared_ptr<Store>& store, int rank, int size) {
  DTRAIN_CHECK_ARG(store, what, ": store is null");
  DTRAIN_CHECK_ARG(size > 0, what, ": size must be positive, got ", size);
  DTRAIN_CHECK_ARG(rank >= 0 && rank < size, what, ": rank ", rank,
                   " is out of range for size ", size, " (expected 0..", size - 1, ")");
}

}  // namespace

void register_backend(const std::string& name, BackendFactory factory) {
  DTRAIN_CHECK_ARG(!name.empty() && factory, "register_backend: need a name and a factory");
  add(name, Entry{{}, nullptr, std::move(factory)});
}

void register_backend(const std::string& name, std::vector<c10::DeviceType> devices,
                      MakeBackend make) {
  DTRAIN_CHECK_ARG(!name.empty() && make && !devices.empty(),
                   "register_backend: need a name, device types and a factory");
  add(name, Entry{std::move(devices), std::move(make), nullptr});
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
  auto entry = find(backend);
  check_group("create_process_group", store, rank, size);
  if (entry.groups) return entry.groups(std::move(store), rank, size, options);
  auto made = entry.make(std::move(store), rank, size, options);
  DTRAIN_CHECK_ARG(made, "backend '", backend, "': its factory returned no backend");
  DeviceBackends backends;
  for (auto type : entry.devices) backends[type] = made;
  return std::make_shared<ProcessGroup>(rank, size, options, std::move(backends));
}

namespace detail {

BackendPtr create_backend(const std::string& name, std::shared_ptr<Store> store, int rank,
                          int size, const GroupOptions& options) {
  auto entry = find(name);
  check_group("create_backend", store, rank, size);
  if (!entry.make)
    throw BackendUnavailable(detail::cat("backend '", name, "' makes whole groups, not a backend "
                                         "that a group can hold beside others"));
  return entry.make(std::move(store), rank, size, options);
}

}  // namespace detail

}  // namespace dtrain
