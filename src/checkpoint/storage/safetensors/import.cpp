// The safetensors storage's reader: each entry of a state reads only its
// own part of its tensor (a box, or a flat range of a tensor whose shape
// the file gives), from whichever file holds it (reader.h).

#include <ATen/ATen.h>

#include "checkpoint/storage/safetensors/reader.h"
#include "checkpoint/storage/safetensors/safetensors.h"

namespace dtrain::checkpoint::storage::safetensors_files {

std::string default_rename(const std::string& entry) {
  size_t start = 0;
  while (start < entry.size()) {
    const size_t slash = entry.find('/', start);
    if (slash == std::string::npos) return "";
    const std::string part = entry.substr(start, slash - start);
    if (part == "param" || part == "buffer") return entry.substr(slash + 1);
    if (part == "optim" || part == "fsdp" || part == "zero") return "";
    start = slash + 1;
  }
  return "";
}

namespace {

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
      out.fills.emplace_back(t, files.read_box(in_file, name, t.scalar_type(), shape,
                                               std::vector<int64_t>(shape.size(), 0), t.sizes()));
    }
    for (const auto& [name, s] : state.sharded) {
      const std::string in_file = rename_(name);
      if (in_file.empty()) continue;
      if (s.is_box())
        out.fills.emplace_back(s.local, files.read_box(in_file, name, s.local.scalar_type(), s.shape, s.offsets,
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
