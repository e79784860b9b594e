// export_safetensors() and import_safetensors(): a staging checkpoint of
// the directory storage, converted by rank 0 into the safetensors
// storage's files; and those files read into any layout's pieces.

#include "dtrain/checkpoint/safetensors.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "checkpoint/checkpointer.h"
#include "checkpoint/rank0_step.h"
#include "checkpoint/storage/directory/directory.h"
#include "checkpoint/storage/safetensors/safetensors.h"
#include "common/enforce.h"
#include "common/error_text.h"
#include "common/paths.h"
#include "dtrain/distributed.h"
#include "dtrain/objects.h"

namespace dtrain::checkpoint {
namespace {

namespace st = storage::safetensors_files;
using dtrain::detail::error_of;

void make_dirs(const std::string& dir) {
  for (size_t slash = dir.find('/', 1);; slash = dir.find('/', slash + 1)) {
    const std::string prefix = dir.substr(0, slash);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST)
      throw Error("cannot create directory " + prefix + ": " + std::strerror(errno));
    if (slash == std::string::npos) break;
  }
  DTRAIN_CHECK_ARG(paths::is_directory(dir), dir, " is not a directory");
}

}  // namespace

void export_safetensors(const std::string& dir, const DistributedState& state, const SafetensorsOptions& options) {
  auto group = options.process_group() ? options.process_group() : default_group();
  DTRAIN_CHECK_ARG(group && group->rank() >= 0, "export_safetensors: this rank is not in the group");
  DTRAIN_CHECK_ARG(options.max_shard_bytes() > 0, "export_safetensors: max_shard_bytes must be positive, got ",
                   options.max_shard_bytes());
  const st::Rename rename = options.rename() ? options.rename() : st::Rename(st::default_rename);
  DistributedState chosen;
  for (const auto& [name, t] : state.replicated)
    if (!rename(name).empty()) chosen.replicated[name] = t;
  for (const auto& [name, s] : state.sharded)
    if (!rename(name).empty()) chosen.sharded[name] = s;
  chosen.metadata = state.metadata;
  chosen.before_save = state.before_save;  // gathers of FSDP's shards: the values of now
  const std::string context = "export_safetensors " + dir;
  auto together = [&](const std::string& error) {
    try {
      fail_together(*group, error);
    } catch (const Error& e) {
      throw Error(context + ": " + e.what());
    }
  };
  together(group->rank() == 0 ? error_of([&] { make_dirs(dir); }) : "");
  const std::string staging = paths::join(dir, ".dtrain-export");
  Checkpointer::of(group)->save(*storage::directory::writer(staging, "checkpoint::save"), chosen);
  // The others wait for rank 0's word, not under a deadline on the whole
  // conversion (checkpoint/rank0_step.h).
  together(detail::run_on_rank0(*group, context, [&] {
    return error_of([&] {
      st::write_export(dir, *storage::directory::whole_entries(staging), rename, options.max_shard_bytes());
      paths::remove_all(staging);
    });
  }));
}

void import_safetensors(const std::string& dir, DistributedState& state, const SafetensorsOptions& options) {
  load_state(*st::reader(dir, options.rename() ? options.rename() : st::Rename(st::default_rename)), state);
}

}  // namespace dtrain::checkpoint
