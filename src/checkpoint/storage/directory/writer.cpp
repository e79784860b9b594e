// The directory storage's writer: each rank's data file, then the
// metadata file that commits them (layout.h has the files).

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "checkpoint/storage/directory/directory.h"
#include "checkpoint/storage/directory/layout.h"
#include "common/enforce.h"
#include "common/paths.h"
#include "dtrain/objects.h"
#include "dtrain/process_group.h"

namespace dtrain::checkpoint::storage::directory {
namespace {

using files::data_file;
using files::error_of;
using files::join_counts;
using files::kFormat;
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

// This rank's data file: "r/<name>" and "s/<name>" with where each piece
// lies (a box keeps its shape; a flat range is 1-D).
TensorFile data_of(const Part& part) {
  TensorFile mine;
  for (const auto& [name, t] : part.replicated) mine.tensors["r/" + name] = t;
  for (const auto& [name, s] : part.sharded) {
    if (s.is_box()) {
      mine.tensors["s/" + name] = s.local;
      mine.metadata["box/" + name] = join_counts(s.offsets);
      continue;
    }
    mine.tensors["s/" + name] = s.local.reshape({-1});
    mine.metadata["offset/" + name] = std::to_string(s.offset);
  }
  return mine;
}

TensorFile metadata_of(const SavePlan& plan, const std::string& token, int world,
                       const std::map<std::string, std::string>& user) {
  TensorFile meta;
  meta.metadata["format"] = kFormat;
  meta.metadata["token"] = token;
  meta.metadata["world_size"] = std::to_string(world);
  for (const auto& [name, r] : plan.replicated_owner) meta.metadata["replicated/" + name] = std::to_string(r);
  for (const auto& [name, n] : plan.sharded_numel) meta.metadata["sharded/" + name] = std::to_string(n);
  for (const auto& [name, shape] : plan.sharded_shape) meta.metadata["shape/" + name] = join_counts(shape);
  for (const auto& [name, shape] : plan.flat_shape) meta.metadata["flat_shape/" + name] = join_counts(shape);
  for (const auto& [key, value] : user) meta.metadata["u/" + key] = value;
  return meta;
}

class DirectoryWriter final : public Writer {
 public:
  DirectoryWriter(const std::string& dir, const std::string& what, const WriteFaults& faults, bool die_before_commit)
      : dir_(dir), context_(what + " " + dir), faults_(faults), die_before_commit_(die_before_commit) {}

  const std::string& context() const override { return context_; }
  const char* lane() const override { return "async_save"; }
  void prepare(ProcessGroup& group) override { token_ = new_token(group); }

  Written write(const Part& part, const SavePlan& plan, const std::shared_ptr<ProcessGroup>& on,
                const std::string& prior) override {
    ProcessGroup& group = *on;
    std::string error = prior;
    if (error.empty()) error = error_of([&] { make_dir(dir_); });
    agree(group, error);
    // Every data file durable, or every rank throws the first failure.
    const TensorFile mine = data_of(part);
    agree(group, error_of([&] { save_tensor_file(data_file(dir_, token_, group.rank()), mine, faults_); }));
    std::string committed;
    if (group.rank() == 0) committed = error_of([&] {
      if (die_before_commit_) ::raise(SIGKILL);
      save_tensor_file(paths::join(dir_, kMetadataFile), metadata_of(plan, token_, group.size(), part.metadata));
      remove_stale(dir_, token_);
    });
    agree(group, committed);  // committed, or every rank says why not
    return Written{};
  }

 private:
  // Every rank's outcome of a step (dtrain::fail_together), named after the save.
  void agree(ProcessGroup& group, const std::string& error) const {
    try {
      fail_together(group, error);
    } catch (const Error& e) {
      throw Error(context_ + ": " + e.what());
    }
  }

  std::string dir_, context_, token_;
  WriteFaults faults_;
  bool die_before_commit_;
};

}  // namespace

std::unique_ptr<Writer> writer(const std::string& dir, const std::string& what, const WriteFaults& faults,
                               bool die_before_commit) {
  return std::make_unique<DirectoryWriter>(dir, what, faults, die_before_commit);
}

}  // namespace dtrain::checkpoint::storage::directory
