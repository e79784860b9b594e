// Saving a distributed checkpoint: each rank's data file, then the
// metadata file that commits them (distributed_files.h has the layout).

#include "dtrain/checkpoint/distributed.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <random>

#include <ATen/core/grad_mode.h>

#include "common/enforce.h"
#include "checkpoint/distributed_files.h"
#include "checkpoint/save_plan.h"
#include "common/paths.h"
#include "dtrain/distributed.h"
#include "dtrain/objects.h"

namespace dtrain::checkpoint {
namespace {

using files::data_file;
using files::error_of;
using files::kFormat;
using files::check_local;
using files::kMetadataFile;

std::string new_token(ProcessGroup& group) {
  int64_t value = 0;
  if (group.rank() == 0) {
    std::random_device device;
    value = static_cast<int64_t>((static_cast<uint64_t>(device()) << 31) ^ device() ^
                                 static_cast<uint64_t>(::getpid()));
  }
  auto t = at::full({1}, value, at::TensorOptions().dtype(at::kLong).device(group.control_device()));
  group.broadcast(t, 0)->wait();
  t = t.cpu();
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(t.item<int64_t>()));
  return text;
}

void make_dir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
    throw Error("checkpoint: cannot create directory " + dir + ": " + std::strerror(errno));
  DTRAIN_CHECK_ARG(paths::is_directory(dir), "checkpoint: ", dir, " is not a directory");
}

// Data files that the committed token does not name: older checkpoints'
// and those of saves that died.
void remove_stale(const std::string& dir, const std::string& token) {
  for (const auto& name : paths::list(dir))
    if (name.rfind("data-", 0) == 0 && name.find("-" + token + "-") == std::string::npos &&
        name.size() > 4 && name.compare(name.size() - 4, 4, ".dtt") == 0)
      ::unlink(paths::join(dir, name).c_str());
}


// Every rank's outcome of a step (dtrain::fail_together), named after the save.
void agree(ProcessGroup& group, const std::string& error, const std::string& context) {
  try {
    fail_together(group, error);
  } catch (const Error& e) {
    throw Error(context + ": " + e.what());
  }
}

}  // namespace

void save(const std::string& dir, const DistributedState& state, SaveOptions options) {
  auto group = options.process_group() ? options.process_group() : default_group();
  DTRAIN_CHECK_ARG(group && group->rank() >= 0, "checkpoint::save: this rank is not in the group");
  check_local(state);
  const auto plan = files::plan_save(group, state);
  const int rank = group->rank(), world = group->size();
  const std::string token = new_token(*group);
  const std::string context = "checkpoint::save " + dir;
  agree(*group, error_of([&] { make_dir(dir); }), context);
  TensorFile mine;
  for (const auto& [name, t] : state.replicated)
    if (plan.replicated_owner.at(name) == rank) mine.tensors["r/" + name] = t;
  for (const auto& [name, s] : state.sharded) {
    if (!plan.my_pieces.count(name)) continue;
    if (s.is_box()) {  // kept in its shape: the file gives the box's sizes
      mine.tensors["s/" + name] = s.local;
      mine.metadata["box/" + name] = files::join_counts(s.offsets);
      continue;
    }
    mine.tensors["s/" + name] = s.local.reshape({-1});
    mine.metadata["offset/" + name] = std::to_string(s.offset);
  }
  // Every data file durable, or every rank throws the first failure.
  agree(*group, error_of([&] { save_tensor_file(data_file(dir, token, rank), mine, options.faults()); }),
        context);
  std::string committed;
  if (rank == 0) committed = error_of([&] {
    if (options.die_before_commit()) ::raise(SIGKILL);
    TensorFile meta;
    meta.metadata["format"] = kFormat;
    meta.metadata["token"] = token;
    meta.metadata["world_size"] = std::to_string(world);
    for (const auto& [name, r] : plan.replicated_owner) meta.metadata["replicated/" + name] = std::to_string(r);
    for (const auto& [name, n] : plan.sharded_numel) meta.metadata["sharded/" + name] = std::to_string(n);
    for (const auto& [name, shape] : plan.sharded_shape) meta.metadata["shape/" + name] = files::join_counts(shape);
    for (const auto& [key, value] : state.metadata) meta.metadata["u/" + key] = value;
    save_tensor_file(paths::join(dir, kMetadataFile), meta);
    remove_stale(dir, token);
  });
  agree(*group, committed, context);  // committed, or every rank says why not
}

}  // namespace dtrain::checkpoint
