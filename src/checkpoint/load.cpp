// Loading, whatever the storage (checkpointer.h's load_state), and load():
// the directory storage's reader. No process group.

#include <ATen/core/grad_mode.h>

#include "checkpoint/checkpointer.h"
#include "checkpoint/storage/directory/directory.h"
#include "dtrain/checkpoint/distributed.h"

namespace dtrain::checkpoint {

bool load_state(storage::Reader& reader, DistributedState& state) {
  auto loaded = reader.read(state);
  if (!loaded) return false;
  {
    at::NoGradGuard no_grad;
    for (auto& [to, from] : loaded->fills) to.detach().copy_(from.reshape(to.sizes()));
  }
  if (loaded->metadata) state.metadata = std::move(*loaded->metadata);
  for (const auto& hook : state.after_load) hook();
  return true;
}

void load(const std::string& dir, DistributedState& state) {
  load_state(*storage::directory::reader(dir), state);
}

}  // namespace dtrain::checkpoint
