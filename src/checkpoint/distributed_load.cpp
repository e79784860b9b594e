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

// Which elements of a staged tensor the pieces read so far have written:
// one flag per element, so that coverage is exact whatever the pieces are
// (an N-D box is a narrow() of the staged tensor and of the flags in each
// dimension: the same calls).
class Coverage {
 public:
  explicit Coverage(int64_t numel) : written_(at::zeros({numel}, at::kBool)) {}

  bool complete() const { return count_ == written_.numel(); }

  // Writes `piece` into `into`, the part of the staged tensor that starts
  // at element `first`. Where an earlier piece wrote already, the two must
  // agree: returns the first element where they differ (nothing is
  // written then), else -1.
  int64_t add(at::Tensor into, const at::Tensor& piece, int64_t first) {
    at::Tensor seen = written_.narrow(0, first, into.numel());
    const int64_t before = seen.sum().item<int64_t>();
    if (before > 0) {
      at::Tensor same = into.eq(piece);
      if (into.is_floating_point() || into.is_complex())
        same = same.logical_or(into.isnan().logical_and(piece.isnan()));  // NaN agrees with NaN
      const at::Tensor differ = seen.logical_and(same.logical_not()).nonzero();
      if (differ.numel() > 0) return first + differ[0][0].item<int64_t>();
    }
    into.copy_(piece);
    seen.fill_(true);
    count_ += into.numel() - before;
    return -1;
  }

  // The first run of elements no piece wrote, as [lo, hi); lo == hi when
  // every element was written.
  std::pair<int64_t, int64_t> first_gap() const {
    if (complete()) return {0, 0};
    const at::Tensor missing = written_.logical_not().nonzero().view({-1});
    const int64_t lo = missing[0].item<int64_t>();
    const at::Tensor after = written_.narrow(0, lo, written_.numel() - lo).nonzero();
    return {lo, after.numel() > 0 ? lo + after[0][0].item<int64_t>() : written_.numel()};
  }

 private:
  at::Tensor written_;
  int64_t count_ = 0;
};

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
  // that overlap it (a new tensor shaped like out.local). Every element
  // must come from a piece: `save` writes disjoint pieces that cover the
  // entry, so a gap, or an overlap whose values differ, means files that
  // were changed or mixed up after the save, and is refused by name rather
  // than loaded as whatever memory held.
  at::Tensor read_sharded(const std::string& name, const ShardedTensor& out) {
    auto it = meta.find("sharded/" + name);
    DTRAIN_CHECK_ARG(it != meta.end(), what, ": has no sharded '", name, "'");
    const int64_t numel = files::parse_count(what + ": the size of '" + name + "'", it->second);
    DTRAIN_CHECK_ARG(numel == out.numel, what, ": sharded '", name, "' has ", numel,
                     " elements in the checkpoint but ", out.numel, " here");
    const int64_t lo = out.offset, hi = out.offset + out.local.numel();
    at::Tensor staged = at::empty({hi - lo}, out.local.options().device(at::kCPU));
    Coverage coverage(hi - lo);
    for (int r = 0; r < world && !coverage.complete(); ++r) {
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
      const int64_t clash = coverage.add(staged.narrow(0, a - lo, b - a), piece.narrow(0, a - start, b - a),
                                         a - lo);
      DTRAIN_CHECK_ARG(clash < 0, what, ": rank ", r, "'s piece of '", name,
                       "' overlaps another piece with different values (first at element ",
                       lo + clash, "); the checkpoint's files were changed or mixed up");
    }
    const auto [gap_lo, gap_hi] = coverage.first_gap();
    DTRAIN_CHECK_ARG(gap_lo == gap_hi, what, ": the saved pieces of '", name, "' do not cover elements [",
                     lo + gap_lo, ", ", lo + gap_hi, ")");
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
