// The directory storage's readers: a distributed checkpoint loaded at any
// world size (the metadata file, then only the pieces that overlap what
// this rank holds), or read whole an entry at a time (layout.h has the
// files). Torch's ops only; no process
// group.

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <map>
#include <string>
#include <memory>
#include <utility>
#include <vector>

#include "checkpoint/storage/directory/layout.h"
#include "checkpoint/storage/directory/directory.h"
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
  explicit Coverage(at::IntArrayRef sizes) : written_(at::zeros(sizes, at::kBool)) {}

  bool complete() const { return count_ == written_.numel(); }
  int64_t missing() const { return written_.numel() - count_; }
  // The flags, to narrow() as the staged tensor is for add().
  const at::Tensor& flags() const { return written_; }

  // Writes `piece` into `into`, a part of the staged tensor whose flags
  // are `seen` (the same narrow() of flags()). Where an earlier piece wrote
  // already, the two must agree: returns the coordinates in `into` of the
  // first element where they differ (nothing is written then), else an
  // empty vector.
  std::vector<int64_t> add(at::Tensor into, const at::Tensor& piece, at::Tensor seen) {
    const int64_t before = seen.sum().item<int64_t>();
    if (before > 0) {
      at::Tensor same = into.eq(piece);
      if (into.is_floating_point() || into.is_complex())
        same = same.logical_or(into.isnan().logical_and(piece.isnan()));  // NaN agrees with NaN
      const at::Tensor differ = seen.logical_and(same.logical_not()).nonzero();
      if (differ.numel() > 0) {
        const at::Tensor first = differ[0].contiguous();
        return std::vector<int64_t>(first.data_ptr<int64_t>(), first.data_ptr<int64_t>() + first.numel());
      }
    }
    into.copy_(piece);
    seen.fill_(true);
    count_ += into.numel() - before;
    return {};
  }

  // Of a 1-D coverage: the first run of elements no piece wrote, as
  // [lo, hi); lo == hi when every element was written.
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

// "[a:b, c:d]" of a box.
std::string box_text(const std::vector<int64_t>& offsets, at::IntArrayRef sizes) {
  std::string out;
  for (size_t d = 0; d < offsets.size(); ++d)
    out += (d ? ", " : "") + std::to_string(offsets[d]) + ":" + std::to_string(offsets[d] + sizes[d]);
  return "[" + out + "]";
}

}  // namespace

namespace load_files {

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
    DTRAIN_CHECK_ARG(!meta.count("shape/" + name), what, ": sharded '", name, "' was saved as boxes of a "
                     "whole of shape ", files::shape_text(files::parse_counts(what + ": the shape of '" + name + "'",
                                                                             meta.at("shape/" + name))),
                     ", and is asked for here as a flat range");
    const int64_t lo = out.offset, hi = out.offset + out.local.numel();
    at::Tensor staged = at::empty({hi - lo}, out.local.options().device(at::kCPU));
    Coverage coverage(std::vector<int64_t>{hi - lo});
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
      const auto clash = coverage.add(staged.narrow(0, a - lo, b - a), piece.narrow(0, a - start, b - a),
                                      coverage.flags().narrow(0, a - lo, b - a));
      DTRAIN_CHECK_ARG(clash.empty(), what, ": rank ", r, "'s piece of '", name,
                       "' overlaps another piece with different values (first at element ",
                       clash.empty() ? 0 : a + clash[0], "); the checkpoint's files were changed or mixed up");
    }
    const auto [gap_lo, gap_hi] = coverage.first_gap();
    DTRAIN_CHECK_ARG(gap_lo == gap_hi, what, ": the saved pieces of '", name, "' do not cover elements [",
                     lo + gap_lo, ", ", lo + gap_hi, ")");
    return staged;
  }

  // The box [offsets, offsets + sizes) of a sharded entry saved as boxes
  // of a whole of `shape`, assembled from the saved boxes that overlap it,
  // each element from exactly one value (as read_sharded).
  at::Tensor read_box(const std::string& name, const std::vector<int64_t>& shape,
                      const std::vector<int64_t>& offsets, at::IntArrayRef sizes, const at::Tensor& like) {
    auto it = meta.find("shape/" + name);
    DTRAIN_CHECK_ARG(it != meta.end(), what, ": sharded '", name, "' was saved as flat ranges, and is "
                     "asked for here as a box of a whole of shape ", files::shape_text(shape));
    const auto saved_shape = files::parse_counts(what + ": the shape of '" + name + "'", it->second);
    DTRAIN_CHECK_ARG(saved_shape == shape, what, ": '", name, "' has shape ", files::shape_text(saved_shape),
                     " in the checkpoint but ", files::shape_text(shape), " here");
    at::Tensor staged = at::empty(sizes, like.options().device(at::kCPU));
    Coverage coverage(sizes);
    for (int r = 0; r < world && !coverage.complete(); ++r) {
      const auto& file = reader(r);
      auto at_box = file.metadata().find("box/" + name);
      if (at_box == file.metadata().end()) continue;
      const auto from = files::parse_counts(what + ": the box of '" + name + "'", at_box->second);
      const auto piece_sizes = file.shape("s/" + name);
      bool inside = from.size() == shape.size() && piece_sizes.size() == shape.size();
      for (size_t d = 0; inside && d < shape.size(); ++d) inside = from[d] + piece_sizes[d] <= shape[d];
      DTRAIN_CHECK_ARG(inside, what, ": rank ", r, "'s piece of '", name, "' lies outside its whole of shape ",
                       files::shape_text(shape));
      at::Tensor into = staged, seen = coverage.flags(), piece;
      std::vector<int64_t> lo(shape.size());
      bool overlaps = true;
      for (size_t d = 0; overlaps && d < shape.size(); ++d) {
        lo[d] = std::max(offsets[d], from[d]);
        const int64_t hi = std::min(offsets[d] + sizes[d], from[d] + piece_sizes[d]);
        overlaps = lo[d] < hi;
        into = into.narrow(d, lo[d] - offsets[d], std::max<int64_t>(hi - lo[d], 0));
        seen = seen.narrow(d, lo[d] - offsets[d], std::max<int64_t>(hi - lo[d], 0));
      }
      if (!overlaps) continue;
      piece = file.read("s/" + name);
      check_dtype(name, piece, like);
      for (size_t d = 0; d < shape.size(); ++d) piece = piece.narrow(d, lo[d] - from[d], into.size(d));
      auto clash = coverage.add(into, piece, seen);
      for (size_t d = 0; d < clash.size(); ++d) clash[d] += lo[d];
      DTRAIN_CHECK_ARG(clash.empty(), what, ": rank ", r, "'s piece of '", name,
                       "' overlaps another piece with different values (first at ", files::shape_text(clash),
                       "); the checkpoint's files were changed or mixed up");
    }
    DTRAIN_CHECK_ARG(coverage.complete(), what, ": the saved pieces of '", name, "' do not cover ",
                     coverage.missing(), " elements of ", box_text(offsets, sizes));
    return staged;
  }

  // A whole `like` from an entry saved replicated, or as pieces.
  at::Tensor read_whole(const std::string& name, const at::Tensor& like) {
    if (meta.count("replicated/" + name) || !meta.count("sharded/" + name)) return read_replicated(name, like);
    if (meta.count("shape/" + name))
      return read_box(name, like.sizes().vec(), std::vector<int64_t>(like.dim(), 0), like.sizes(), like);
    const ShardedTensor flat{like.reshape({-1}), 0, like.numel()};
    return read_sharded(name, flat).view(like.sizes());
  }

  // This rank's piece: flat, or a box of an entry saved as boxes or whole.
  // A flat range that says its whole's shape reads from an entry saved
  // whole or as boxes too (the whole read, then its range kept).
  at::Tensor read_piece(const std::string& name, const ShardedTensor& out) {
    if (!out.is_box() && !out.flat_shape.empty() && (meta.count("replicated/" + name) || meta.count("shape/" + name)))
      return read_whole(name, at::empty(out.flat_shape, out.local.options().device(at::kCPU)))
          .reshape({-1})
          .narrow(0, out.offset, out.local.numel())
          .clone();
    if (!out.is_box()) return read_sharded(name, out);
    if (meta.count("sharded/" + name)) return read_box(name, out.shape, out.offsets, out.local.sizes(), out.local);
    at::Tensor whole = read_replicated(name, at::empty(out.shape, out.local.options().device(at::kCPU)));
    for (size_t d = 0; d < out.shape.size(); ++d) whole = whole.narrow(d, out.offsets[d], out.local.size(d));
    return whole.contiguous();
  }

  // An entry's whole shape and dtype, without reading its values; flat
  // ranges that do not say their whole's shape (FSDP's and ZeRO's shards)
  // are refused.
  storage::EntryInfo info_of(const std::string& name) {
    storage::EntryInfo e{name, at::kFloat, {}};
    if (auto it = meta.find("replicated/" + name); it != meta.end()) {
      const int64_t r = files::parse_count(what + ": the rank of '" + name + "'", it->second);
      DTRAIN_CHECK_ARG(r < world, what, ": '", name, "' is in rank ", r, "'s file, beyond world size ", world);
      e.shape = reader(static_cast<int>(r)).shape("r/" + name);
      e.dtype = reader(static_cast<int>(r)).dtype("r/" + name);
      return e;
    }
    DTRAIN_CHECK_ARG(meta.count("sharded/" + name), what, ": has no entry '", name, "'");
    if (auto flat = meta.find("flat_shape/" + name); flat != meta.end()) {
      e.shape = files::parse_counts(what + ": the shape of '" + name + "'", flat->second);
      for (int r = 0; r < world; ++r)
        if (reader(r).metadata().count("offset/" + name)) {
          e.dtype = reader(r).dtype("s/" + name);
          return e;
        }
      throw InvalidArgument(what + ": no rank's file holds a piece of '" + name + "'");
    }
    DTRAIN_CHECK_ARG(meta.count("shape/" + name), what, ": '", name, "' was saved as flat ranges (FSDP's or "
                     "ZeRO's shards), which are no tensor of a shape; save parameters by name "
                     "(add_module, add_fsdp_parameters)");
    e.shape = files::parse_counts(what + ": the shape of '" + name + "'", meta.at("shape/" + name));
    for (int r = 0; r < world; ++r)
      if (reader(r).metadata().count("box/" + name)) {
        e.dtype = reader(r).dtype("s/" + name);
        return e;
      }
    throw InvalidArgument(what + ": no rank's file holds a piece of '" + name + "'");
  }

  at::Tensor whole_of(const storage::EntryInfo& e) {
    const at::Tensor like = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    return read_whole(e.name, like);
  }

  void check_dtype(const std::string& name, const at::Tensor& saved, const at::Tensor& like) const {
    DTRAIN_CHECK_ARG(saved.scalar_type() == like.scalar_type(), what, ": '", name, "' is ",
                     saved.scalar_type(), " in the checkpoint but ", like.scalar_type(), " here");
  }
};

}  // namespace load_files

using load_files::Saved;

namespace storage::directory {
namespace {

class DirectoryReader final : public Reader {
 public:
  explicit DirectoryReader(const std::string& dir) : dir_(dir) {}

  std::optional<Loaded> read(const DistributedState& state) override {
    check_local(state);
    Saved saved(dir_);
    Loaded out;
    for (auto& [name, t] : state.replicated) out.fills.emplace_back(t, saved.read_whole(name, t));
    for (auto& [name, s] : state.sharded) out.fills.emplace_back(s.local, saved.read_piece(name, s));
    out.metadata.emplace();
    for (const auto& [key, value] : saved.meta)
      if (key.rfind("u/", 0) == 0) (*out.metadata)[key.substr(2)] = value;
    return out;
  }

 private:
  std::string dir_;
};

class WholeDirectory final : public WholeEntries {
 public:
  explicit WholeDirectory(const std::string& dir) : saved_(dir) {}

  std::vector<EntryInfo> entries() override {
    std::vector<EntryInfo> out;
    for (const auto& [key, value] : saved_.meta) {
      if (key.rfind("replicated/", 0) == 0) out.push_back(saved_.info_of(key.substr(11)));
      if (key.rfind("sharded/", 0) == 0) out.push_back(saved_.info_of(key.substr(8)));
    }
    return out;
  }
  at::Tensor read(const EntryInfo& entry) override { return saved_.whole_of(entry); }
  std::map<std::string, std::string> metadata() override {
    std::map<std::string, std::string> user;
    for (const auto& [key, value] : saved_.meta)
      if (key.rfind("u/", 0) == 0) user[key.substr(2)] = value;
    return user;
  }

 private:
  Saved saved_;
};

}  // namespace

std::unique_ptr<Reader> reader(const std::string& dir) { return std::make_unique<DirectoryReader>(dir); }
std::unique_ptr<WholeEntries> whole_entries(const std::string& dir) { return std::make_unique<WholeDirectory>(dir); }

}  // namespace storage::directory

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
