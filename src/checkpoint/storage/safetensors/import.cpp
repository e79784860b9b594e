// The safetensors storage's reader: each entry of a state reads only its
// own part of its tensor (a box, or a flat range of a tensor whose shape
// the file gives), from whichever file holds it (reader.h).

#include <ATen/ATen.h>

#include <cstring>

#include "checkpoint/storage/safetensors/reader.h"
#include "checkpoint/storage/safetensors/safetensors.h"
#include "common/enforce.h"

namespace dtrain::checkpoint::storage::safetensors_files {

namespace {

// GroupedExperts' [E, ...] parameters under Hugging Face's per-expert names.
std::string hugging_face_experts(const std::string& name) {
  static const std::pair<const char*, const char*> kNames[] = {
      {"experts.w1", "experts.{e}.gate_proj.weight"},
      {"experts.w3", "experts.{e}.up_proj.weight"},
      {"experts.w2", "experts.{e}.down_proj.weight"}};
  for (const auto& [ours, theirs] : kNames) {
    const std::string end = ours;
    if (name == end) return theirs;
    if (name.size() > end.size() && name.compare(name.size() - end.size() - 1, end.size() + 1, "." + end) == 0)
      return name.substr(0, name.size() - end.size()) + theirs;
  }
  return name;
}

}  // namespace

std::string default_rename(const std::string& entry) {
  size_t start = 0;
  while (start < entry.size()) {
    const size_t slash = entry.find('/', start);
    if (slash == std::string::npos) return "";
    const std::string part = entry.substr(start, slash - start);
    if (part == "param") return hugging_face_experts(entry.substr(slash + 1));
    if (part == "buffer") return entry.substr(slash + 1);
    if (part == "optim" || part == "fsdp" || part == "zero") return "";
    start = slash + 1;
  }
  return "";
}

std::string indexed(const std::string& name, int64_t index) {
  const auto at = name.find(kIndexMark);
  return at == std::string::npos ? name
                                 : name.substr(0, at) + std::to_string(index) + name.substr(at + std::strlen(kIndexMark));
}

namespace {

bool split(const std::string& name) { return name.find(kIndexMark) != std::string::npos; }

// Box [offsets, offsets + sizes) of an entry of shape `whole` read from the
// files, from one tensor or, under a split name, stacked from one tensor per
// index of its first dimension.
at::Tensor read_box(detail::SafetensorsFiles& files, const std::string& in_file, const std::string& entry,
                    at::ScalarType dtype, const std::vector<int64_t>& whole, const std::vector<int64_t>& offsets,
                    at::IntArrayRef sizes) {
  if (!split(in_file)) return files.read_box(in_file, entry, dtype, whole, offsets, sizes);
  DTRAIN_CHECK_ARG(!whole.empty(), "import_safetensors: entry '", entry, "' is a scalar; '", in_file,
                   "' splits a first dimension");
  const std::vector<int64_t> row(whole.begin() + 1, whole.end()), row_offsets(offsets.begin() + 1, offsets.end());
  std::vector<at::Tensor> rows;
  for (int64_t i = offsets[0]; i < offsets[0] + sizes[0]; ++i)
    rows.push_back(files.read_box(indexed(in_file, i), entry, dtype, row, row_offsets, sizes.slice(1)));
  return rows.empty() ? at::empty(sizes, at::TensorOptions().dtype(dtype)) : at::stack(rows);
}

class SafetensorsReader final : public Reader {
 public:
  SafetensorsReader(const std::string& dir, Rename rename) : dir_(dir), rename_(std::move(rename)) {}

  std::optional<Loaded> read(const DistributedState& state) override {
    detail::SafetensorsFiles files(dir_);
    Loaded out;
    for (const auto& [name, t] : state.replicated) {
      const std::string in_file = rename_(name);
      if (in_file.empty()) continue;
      const auto shape = t.sizes().vec();
      out.fills.emplace_back(t, read_box(files, in_file, name, t.scalar_type(), shape,
                                         std::vector<int64_t>(shape.size(), 0), t.sizes()));
    }
    for (const auto& [name, s] : state.sharded) {
      const std::string in_file = rename_(name);
      if (in_file.empty()) continue;
      DTRAIN_CHECK_ARG(s.is_box() || !split(in_file), "import_safetensors: entry '", name,
                       "' is a flat range; '", in_file, "' splits a first dimension (use add_fsdp_parameters)");
      if (s.is_box())
        out.fills.emplace_back(s.local, read_box(files, in_file, name, s.local.scalar_type(), s.shape, s.offsets,
                                                 s.local.sizes()));
      else
        out.fills.emplace_back(s.local, files.read_range(in_file, name, s.local.scalar_type(), s.numel, s.offset,
                                                         s.local.numel()));
    }
    return out;
  }

 private:
  std::string dir_;
  Rename rename_;
};

}  // namespace

std::unique_ptr<Reader> reader(const std::string& dir, Rename rename) {
  return std::make_unique<SafetensorsReader>(dir, std::move(rename));
}

}  // namespace dtrain::checkpoint::storage::safetensors_files
