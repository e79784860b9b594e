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
#include "checkpoint/save_job.h"
#include "checkpoint/save_plan.h"
#include "common/paths.h"
#include "dtrain/distributed.h"
#include "dtrain/objects.h"

namespace dtrain::checkpoint {
namespace {

using files::join_counts;

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

namespace files {

SaveJob prepare_save(const std::string& dir, const DistributedState& state,
                     const std::shared_ptr<ProcessGroup>& group, const std::string& what,
                     const WriteFaults& faults, bool die_before_commit) {
  const std::string context = what + " " + dir;
  DTRAIN_CHECK_ARG(group && group->rank() >= 0, context, ": this rank is not in the group");
  wait_for_async_save(group, context);
  for (const auto& hook : state.before_save) hook();
  check_local(state);
  SaveJob job;
  job.dir = dir;
  job.context = context;
  job.faults = faults;
  job.die_before_commit = die_before_commit;
  job.plan = plan_save(group, state);
  job.rank = group->rank();
  job.world = group->size();
  job.token = new_token(*group);
  job.metadata = state.metadata;
  for (const auto& [name, t] : state.replicated)
    if (job.plan.replicated_owner.at(name) == job.rank) job.mine.tensors["r/" + name] = t;
  for (const auto& [name, s] : state.sharded) {
    if (!job.plan.my_pieces.count(name)) continue;
    if (s.is_box()) {  // kept in its shape: the file gives the box's sizes
      job.mine.tensors["s/" + name] = s.local;
      job.mine.metadata["box/" + name] = join_counts(s.offsets);
      continue;
    }
    job.mine.tensors["s/" + name] = s.local.reshape({-1});
    job.mine.metadata["offset/" + name] = std::to_string(s.offset);
  }
  return job;
}

void write_and_commit(const SaveJob& job, ProcessGroup& group, const std::string& prior_error) {
  const std::string& dir = job.dir;
  std::string error = prior_error;
  if (error.empty()) error = error_of([&] { make_dir(dir); });
  agree(group, error, job.context);
  // Every data file durable, or every rank throws the first failure.
  agree(group, error_of([&] { save_tensor_file(data_file(dir, job.token, job.rank), job.mine, job.faults); }),
        job.context);
  std::string committed;
  if (job.rank == 0) committed = error_of([&] {
    if (job.die_before_commit) ::raise(SIGKILL);
    TensorFile meta;
    meta.metadata["format"] = kFormat;
    meta.metadata["token"] = job.token;
    meta.metadata["world_size"] = std::to_string(job.world);
    const auto& plan = job.plan;
    for (const auto& [name, r] : plan.replicated_owner)
      meta.metadata["replicated/" + name] = std::to_string(r);
    for (const auto& [name, n] : plan.sharded_numel) meta.metadata["sharded/" + name] = std::to_string(n);
    for (const auto& [name, shape] : plan.sharded_shape) meta.metadata["shape/" + name] = join_counts(shape);
    for (const auto& [key, value] : job.metadata) meta.metadata["u/" + key] = value;
    save_tensor_file(paths::join(dir, kMetadataFile), meta);
    remove_stale(dir, job.token);
  });
  agree(group, committed, job.context);  // committed, or every rank says why not
}

}  // namespace files

void save(const std::string& dir, const DistributedState& state, SaveOptions options) {
  auto group = options.process_group() ? options.process_group() : default_group();
  const auto job =
      files::prepare_save(dir, state, group, "checkpoint::save", options.faults(), options.die_before_commit());
  files::write_and_commit(job, *group);
}

}  // namespace dtrain::checkpoint
