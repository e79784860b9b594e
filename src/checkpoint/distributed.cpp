// Distributed checkpoints: each rank's data file, the metadata file that
// commits them, and loading with resharding.
//
//   <dir>/data-<token>-<rank>.dtt   a rank's tensors: "r/<name>" (replicated
//                                   entries assigned to it), "s/<name>" (its
//                                   piece of a sharded entry; file metadata
//                                   "offset/<name>" says where it lies)
//   <dir>/metadata.dtt              written last, atomically, by rank 0:
//                                   the token, the world size, where each
//                                   replicated entry is, each sharded
//                                   entry's size, the user's metadata ("u/")

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
#include "common/paths.h"
#include "dtrain/distributed.h"

namespace dtrain::checkpoint {
namespace {

constexpr const char* kFormat = "dtrain distributed checkpoint 1";
constexpr const char* kMetadataFile = "metadata.dtt";

std::string data_file(const std::string& dir, const std::string& token, int rank) {
  return paths::join(dir, "data-" + token + "-" + std::to_string(rank) + ".dtt");
}

// Every rank must describe the same entries: a hash of names and sizes,
// compared through its minimum and maximum over the group.
void check_same_entries(ProcessGroup& group, const DistributedState& state) {
  std::string text;
  for (const auto& [name, t] : state.replicated)
    text += "r" + name + ":" + std::to_string(t.numel()) + ";";
  for (const auto& [name, s] : state.sharded) text += "s" + name + ":" + std::to_string(s.numel) + ";";
  const auto hash = static_cast<int64_t>(std::hash<std::string>()(text) >> 1);
  auto low = at::full({1}, hash, at::kLong), high = at::full({1}, hash, at::kLong);
  group.all_reduce(low, ReduceOp::MIN)->wait();
  group.all_reduce(high, ReduceOp::MAX)->wait();
  DTRAIN_CHECK_ARG(low.item<int64_t>() == high.item<int64_t>(),
                   "checkpoint::save: the ranks describe different states (names or sizes of "
                   "their replicated and sharded entries differ); every rank must add the same "
                   "objects");
}

void check_local(const DistributedState& state) {
  for (const auto& [name, t] : state.replicated)
    DTRAIN_CHECK_ARG(t.defined(), "checkpoint: replicated '", name, "' is undefined");
  for (const auto& [name, s] : state.sharded) {
    DTRAIN_CHECK_ARG(s.local.defined() && s.local.is_contiguous(), "checkpoint: sharded '", name,
                     "' has no contiguous local tensor");
    DTRAIN_CHECK_ARG(s.offset >= 0 && s.offset + s.local.numel() <= s.numel, "checkpoint: sharded '",
                     name, "' holds elements [", s.offset, ", ", s.offset + s.local.numel(),
                     ") of ", s.numel);
  }
}

// Replicated entries go to the rank with the fewest bytes so far, in name
// order: every rank computes the same assignment.
std::map<std::string, int> assign_replicated(const DistributedState& state, int world) {
  std::vector<int64_t> load(world, 0);
  std::map<std::string, int> owner;
  for (const auto& [name, t] : state.replicated) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[name] = r;
    load[r] += static_cast<int64_t>(t.nbytes());
  }
  return owner;
}

std::string new_token(ProcessGroup& group) {
  auto t = at::zeros({1}, at::kLong);
  if (group.rank() == 0) {
    std::random_device device;
    t[0] = static_cast<int64_t>((static_cast<uint64_t>(device()) << 31) ^ device() ^
                                static_cast<uint64_t>(::getpid()));
  }
  group.broadcast(t, 0)->wait();
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

int64_t parse_int(const std::string& what, const std::string& text) {
  DTRAIN_CHECK_ARG(!text.empty() && text.size() < 20 &&
                       text.find_first_not_of("0123456789") == std::string::npos,
                   what, " is not a count: '", text, "'");
  return std::stoll(text);
}

}  // namespace

void save(const std::string& dir, const DistributedState& state, SaveOptions options) {
  auto group = options.process_group() ? options.process_group() : default_group();
  DTRAIN_CHECK_ARG(group && group->rank() >= 0, "checkpoint::save: this rank is not in the group");
  check_local(state);
  check_same_entries(*group, state);
  const int rank = group->rank(), world = group->size();
  const std::string token = new_token(*group);
  make_dir(dir);
  const auto owner = assign_replicated(state, world);
  TensorFile mine;
  for (const auto& [name, t] : state.replicated)
    if (owner.at(name) == rank) mine.tensors["r/" + name] = t;
  for (const auto& [name, s] : state.sharded) {
    mine.tensors["s/" + name] = s.local.reshape({-1});
    mine.metadata["offset/" + name] = std::to_string(s.offset);
  }
  save_tensor_file(data_file(dir, token, rank), mine, options.faults());
  group->barrier()->wait();  // every data file is durable
  if (rank == 0) {
    if (options.die_before_commit()) ::raise(SIGKILL);
    TensorFile meta;
    meta.metadata["format"] = kFormat;
    meta.metadata["token"] = token;
    meta.metadata["world_size"] = std::to_string(world);
    for (const auto& [name, r] : owner) meta.metadata["replicated/" + name] = std::to_string(r);
    for (const auto& [name, s] : state.sharded) meta.metadata["sharded/" + name] = std::to_string(s.numel);
    for (const auto& [key, value] : state.metadata) meta.metadata["u/" + key] = value;
    save_tensor_file(paths::join(dir, kMetadataFile), meta);
    remove_stale(dir, token);
  }
  group->barrier()->wait();  // committed
}

namespace {

struct Saved {
  std::string dir, what, token;
  int world = 0;
  std::map<std::string, std::string> meta;
  std::map<int, std::unique_ptr<TensorFileReader>> readers;

  explicit Saved(const std::string& d) : dir(d), what("checkpoint " + d) {
    TensorFileReader reader(paths::join(dir, kMetadataFile));
    meta = reader.metadata();
    auto get = [&](const std::string& key) {
      auto it = meta.find(key);
      DTRAIN_CHECK_ARG(it != meta.end(), what, ": the metadata file has no '", key,
                       "' (not a dtrain distributed checkpoint?)");
      return it->second;
    };
    DTRAIN_CHECK_ARG(get("format") == kFormat, what, ": unknown format '", get("format"), "'");
    token = get("token");
    DTRAIN_CHECK_ARG(token.size() == 16 && token.find_first_not_of("0123456789abcdef") == std::string::npos,
                     what, ": bad token '", token, "'");
    const int64_t w = parse_int(what + ": world_size", get("world_size"));
    DTRAIN_CHECK_ARG(w >= 1 && w <= (1 << 20), what, ": world_size ", w, " is out of range");
    world = static_cast<int>(w);
  }

  const TensorFileReader& reader(int rank) {
    auto& r = readers[rank];
    if (!r) r = std::make_unique<TensorFileReader>(data_file(dir, token, rank));
    return *r;
  }

  void fill_replicated(const std::string& name, at::Tensor& out) {
    auto it = meta.find("replicated/" + name);
    DTRAIN_CHECK_ARG(it != meta.end(), what, ": has no replicated '", name, "'");
    const int64_t r = parse_int(what + ": the rank of '" + name + "'", it->second);
    DTRAIN_CHECK_ARG(r < world, what, ": '", name, "' is in rank ", r, "'s file, beyond world size ", world);
    const at::Tensor saved = reader(static_cast<int>(r)).read("r/" + name);
    DTRAIN_CHECK_ARG(saved.sizes() == out.sizes(), what, ": '", name, "' has shape ", saved.sizes(),
                     " in the checkpoint but ", out.sizes(), " here");
    at::NoGradGuard no_grad;
    out.detach().copy_(saved);
  }

  void fill_sharded(const std::string& name, ShardedTensor& out) {
    auto it = meta.find("sharded/" + name);
    DTRAIN_CHECK_ARG(it != meta.end(), what, ": has no sharded '", name, "'");
    const int64_t numel = parse_int(what + ": the size of '" + name + "'", it->second);
    DTRAIN_CHECK_ARG(numel == out.numel, what, ": sharded '", name, "' has ", numel,
                     " elements in the checkpoint but ", out.numel, " here");
    const int64_t lo = out.offset, hi = out.offset + out.local.numel();
    auto flat = out.local.detach().view({-1});
    int64_t covered = 0;
    for (int r = 0; r < world && covered < hi - lo; ++r) {
      const auto& file = reader(r);
      auto off = file.metadata().find("offset/" + name);
      if (off == file.metadata().end()) continue;
      const int64_t start = parse_int(what + ": the offset of '" + name + "'", off->second);
      const auto shape = file.shape("s/" + name);
      DTRAIN_CHECK_ARG(shape.size() == 1 && start + shape[0] <= numel, what, ": rank ", r,
                       "'s piece of '", name, "' lies outside its ", numel, " elements");
      const int64_t a = std::max(lo, start), b = std::min(hi, start + shape[0]);
      if (a >= b) continue;
      const at::Tensor piece = file.read("s/" + name);
      at::NoGradGuard no_grad;
      flat.narrow(0, a - lo, b - a).copy_(piece.narrow(0, a - start, b - a));
      covered += b - a;  // pieces of different ranks do not overlap in what dtrain saves
    }
    DTRAIN_CHECK_ARG(covered >= hi - lo, what, ": the saved pieces of '", name,
                     "' do not cover elements [", lo, ", ", hi, ")");
  }
};

}  // namespace

void load(const std::string& dir, DistributedState& state) {
  check_local(state);
  Saved saved(dir);
  for (auto& [name, t] : state.replicated) saved.fill_replicated(name, t);
  for (auto& [name, s] : state.sharded) saved.fill_sharded(name, s);
  state.metadata.clear();
  for (const auto& [key, value] : saved.meta)
    if (key.rfind("u/", 0) == 0) state.metadata[key.substr(2)] = value;
  for (const auto& hook : state.after_load) hook();
}

CheckpointInfo inspect(const std::string& dir) {
  Saved saved(dir);
  CheckpointInfo info;
  info.world_size = saved.world;
  for (const auto& [key, value] : saved.meta) {
    if (key.rfind("replicated/", 0) == 0) info.replicated.push_back(key.substr(11));
    if (key.rfind("sharded/", 0) == 0) info.sharded.push_back(key.substr(8));
    if (key.rfind("u/", 0) == 0) info.metadata[key.substr(2)] = value;
  }
  return info;
}

}  // namespace dtrain::checkpoint
