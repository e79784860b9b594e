// Loading a distributed checkpoint at any world size: the metadata file,
// then only the pieces that overlap what this rank holds
// (distributed_files.h has the layout). Torch's ops only; no process
// group.

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "checkpoint/distributed_files.h"
#include "common/enforce.h"
#include "dtrain/checkpoint/distributed.h"

namespace dtrain::checkpoint {

using files::data_file;
using files::kFormat;
using files::check_local;
using files::kMetadataFile;

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
    const int64_t w = files::parse_count(what + ": world_size", get("world_size"));
    DTRAIN_CHECK_ARG(w >= 1 && w <= (1 << 20), what, ": world_size ", w, " is out of range");
    world = static_cast<int>(w);
  }

  const TensorFileReader& reader(int rank) {
    auto& r = readers[rank];
    if (!r) r = std::make_unique<TensorFileReader>(data_file(dir, token, rank));
    return *r;
  }

  // The saved value of a replicated entry, checked against `like` (its
  // shape and dtype here).
  at::Tensor read_replicated(const std::string& name, const at::Tensor& like) {
    auto it = meta.find("replicated/" + name);
    DTRAIN_CHECK_ARG(it != meta.end(), what, ": has no replicated '", name, "'");
    const int64_t r = files::parse_count(what + ": the rank of '" + name + "'", it->second);
    DTRAIN_CHECK_ARG(r < world, what, ": '", name, "' is in rank ", r, "'s file, beyond world size ", world);
    at::Tensor saved = reader(static_cast<int>(r)).read("r/" + name);
    DTRAIN_CHECK_ARG(saved.sizes() == like.sizes(), what, ": '", name, "' has shape ", saved.sizes(),
                     " in the checkpoint but ", like.sizes(), " here");
    check_dtype(name, saved, like);
    return saved;
  }

  // This rank's piece of a sharded entry, assembled from the saved pieces
  // that overlap it (a new tensor shaped like out.local).
  at::Tensor read_sharded(const std::string& name, const ShardedTensor& out) {
    auto it = meta.find("sharded/" + name);
    DTRAIN_CHECK_ARG(it != meta.end(), what, ": has no sharded '", name, "'");
    const int64_t numel = files::parse_count(what + ": the size of '" + name + "'", it->second);
    DTRAIN_CHECK_ARG(numel == out.numel, what, ": sharded '", name, "' has ", numel,
                     " elements in the checkpoint but ", out.numel, " here");
    const int64_t lo = out.offset, hi = out.offset + out.local.numel();
    at::Tensor staged = at::empty({hi - lo}, out.local.options().device(at::kCPU));
    int64_t covered = 0;
    for (int r = 0; r < world && covered < hi - lo; ++r) {
      const auto& file = reader(r);
      auto off = file.metadata().find("offset/" + name);
      if (off == file.metadata().end()) continue;
      const int64_t start = files::parse_count(what + ": the offset of '" + name + "'", off->second);
      const auto shape = file.shape("s/" + name);
      DTRAIN_CHECK_ARG(shape.size() == 1 && start + shape[0] <= numel, what, ": rank ", r,
                       "'s piece of '", name, "' lies outside its ", numel, " elements");
      const int64_t a = std::max(lo, start), b = std::min(hi, start + shape[0]);
      if (a >= b) continue;
      const at::Tensor piece = file.read("s/" + name);
      check_dtype(name, piece, out.local);
      staged.narrow(0, a - lo, b - a).copy_(piece.narrow(0, a - start, b - a));
      covered += b - a;  // pieces of different ranks do not overlap in what dtrain saves
    }
    DTRAIN_CHECK_ARG(covered >= hi - lo, what, ": the saved pieces of '", name,
                     "' do not cover elements [", lo, ", ", hi, ")");
    return staged;
  }

  void check_dtype(const std::string& name, const at::Tensor& saved, const at::Tensor& like) const {
    DTRAIN_CHECK_ARG(saved.scalar_type() == like.scalar_type(), what, ": '", name, "' is ",
                     saved.scalar_type(), " in the checkpoint but ", like.scalar_type(), " here");
  }
};

}  // namespace

void load(const std::string& dir, DistributedState& state) {
  check_local(state);
  Saved saved(dir);
  // Everything is read and checked before any tensor of `state` changes.
  std::vector<std::pair<at::Tensor, at::Tensor>> fills;  // {destination, saved}
  for (auto& [name, t] : state.replicated) fills.emplace_back(t, saved.read_replicated(name, t));
  for (auto& [name, s] : state.sharded) fills.emplace_back(s.local.view({-1}), saved.read_sharded(name, s));
  {
    at::NoGradGuard no_grad;
    for (auto& [to, from] : fills) to.detach().copy_(from);
  }
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
