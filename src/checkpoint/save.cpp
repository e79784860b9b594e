// save(): the directory storage through the group's Checkpointer, on the
// caller's thread.

#include "checkpoint/checkpointer.h"
#include "checkpoint/storage/directory/directory.h"
#include "common/enforce.h"
#include "dtrain/checkpoint/distributed.h"
#include "dtrain/distributed.h"

namespace dtrain::checkpoint {

void save(const std::string& dir, const DistributedState& state, SaveOptions options) {
  auto group = options.process_group() ? options.process_group() : default_group();
  DTRAIN_CHECK_ARG(group != nullptr, "checkpoint::save ", dir, ": no process group (call init_process_group)");
  auto writer = storage::directory::writer(dir, "checkpoint::save", options.faults(), options.die_before_commit());
  Checkpointer::of(group)->save(*writer, state);
}

}  // namespace dtrain::checkpoint
