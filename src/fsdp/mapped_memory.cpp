#include "fsdp/mapped_memory.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "dtrain/errors.h"

namespace dtrain::fsdp {
namespace {

struct Mapping {
  void* base;
  size_t bytes;
};

void unmap(void* context) {
  auto* m = static_cast<Mapping*>(context);
  ::munmap(m->base, m->bytes);
  delete m;
}

at::DataPtr map_bytes(size_t bytes, const c10::Device& device) {
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED)
    throw Error("FullyShardedDataParallel: cannot map " + std::to_string(bytes) +
                " bytes for a unit's full parameters or gradients: " + std::strerror(errno));
  return at::DataPtr(base, new Mapping{base, bytes}, &unmap, device);
}

}  // namespace

at::DataPtr allocate_transient(size_t bytes, const c10::Storage& storage, const c10::Device& device) {
  if (!device.is_cpu() || bytes < kMappedMinBytes) return storage.allocator()->allocate(bytes);
  return map_bytes(bytes, device);
}

at::Tensor transient_zeros(int64_t numel, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  if (!options.device().is_cpu() || bytes < kMappedMinBytes) return at::zeros({numel}, options);
  auto data = map_bytes(bytes, options.device());
  void* ptr = data.get();
  auto* context = data.release_context();
  // Fresh anonymous pages read as zeros: no fill needed.
  return at::from_blob(ptr, {numel}, [context](void*) { unmap(context); }, options);
}

}  // namespace dtrain::fsdp
