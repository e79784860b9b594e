// The safetensors storage's writer: a committed checkpoint's entries,
// whole, into Hugging Face's files (model.safetensors, or shards and their
// index), replacing an earlier export as a set.

#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "checkpoint/formats/safetensors_format.h"
#include "checkpoint/storage/safetensors/export_seam.h"
#include "checkpoint/storage/safetensors/reader.h"
#include "checkpoint/storage/safetensors/safetensors.h"
#include "common/durable_file.h"
#include "common/enforce.h"
#include "common/paths.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian, as this host");

namespace dtrain::checkpoint::storage::safetensors_files {
namespace {

namespace st = ::dtrain::safetensors;

st::DType to_file(const std::string& name, at::ScalarType type) { return detail::file_type(name, type); }

bool is_output(const std::string& file) {
  auto ends = [&](const std::string& end) {
    return file.size() >= end.size() && file.compare(file.size() - end.size(), end.size(), end) == 0;
  };
  return file.rfind("model", 0) == 0 && (ends(".safetensors") || file == "model.safetensors.index.json");
}

struct Planned {
  EntryInfo info;
  std::string name;  // in the file
  int64_t index = -1;  // of the entry's first dimension, under a split name
  uint64_t bytes = 0;
  std::vector<int64_t> shape() const {
    return index < 0 ? info.shape : std::vector<int64_t>(info.shape.begin() + 1, info.shape.end());
  }
};

// The tensors entry `info` makes in the files: itself, or under a name with
// the index mark one per index of its first dimension.
std::vector<Planned> planned(const EntryInfo& info, const Rename& rename) {
  const std::string name = rename(info.name);
  if (name.find(kIndexMark) == std::string::npos) return {Planned{info, name}};
  DTRAIN_CHECK_ARG(!info.shape.empty(), "export_safetensors: entry '", info.name, "' is a scalar; '", name,
                   "' splits a first dimension");
  std::vector<Planned> out;
  for (int64_t i = 0; i < info.shape[0]; ++i) out.push_back(Planned{info, indexed(name, i), i});
  return out;
}

// The test seams (checkpoint/export_seam.h).
std::atomic<int> fail_after_files{-1};
std::atomic<int64_t> sleep_per_file_ms{0};

// The files' names for `count` files: "model.safetensors" alone, or Hugging
// Face's "model-00001-of-00003.safetensors" ... unless a file of the earlier
// export has one of those names: then "model-<id>-00001-of-00003...", so
// that no file the earlier index names changes before the new index is in.
std::vector<std::string> file_names(const std::string& dir, size_t count) {
  if (count == 1) return {"model.safetensors"};
  auto names_with = [&](const std::string& id) {
    std::vector<std::string> out;
    for (size_t k = 0; k < count; ++k) {
      char name[64];
      std::snprintf(name, sizeof(name), "-%05zu-of-%05zu.safetensors", k + 1, count);
      out.push_back("model" + id + name);
    }
    return out;
  };
  auto names = names_with("");
  const bool taken = std::any_of(names.begin(), names.end(),
                                 [&](const std::string& n) { return paths::exists(paths::join(dir, n)); });
  if (!taken) return names;
  std::random_device random;
  char id[16];
  std::snprintf(id, sizeof(id), "-%08x", static_cast<unsigned>(random()));
  return names_with(id);
}

}  // namespace

void write_export(const std::string& dir, WholeEntries& saved, const Rename& rename, int64_t max_bytes) {
  std::vector<std::vector<Planned>> files(1);
  std::set<std::string> names;
  uint64_t in_file = 0, total = 0;
  for (auto& info : saved.entries()) {
    for (auto& p : planned(info, rename)) {
      DTRAIN_CHECK_ARG(names.insert(p.name).second, "export_safetensors: two entries are named '", p.name,
                       "' in the files (the last one is '", info.name, "')");
      st::Entry probe{p.name, to_file(info.name, info.dtype), p.shape(), 0, 0};
      std::vector<st::Entry> one{probe};
      st::encode_prefix(one, {});  // checks the name and shape; sets the size
      p.bytes = one[0].end;
      if (!files.back().empty() && in_file + p.bytes > static_cast<uint64_t>(max_bytes)) {
        files.emplace_back();
        in_file = 0;
      }
      in_file += p.bytes;
      total += p.bytes;
      files.back().push_back(std::move(p));
    }
  }
  std::vector<std::pair<std::string, std::string>> metadata{{"format", "pt"}};
  for (const auto& [key, value] : saved.metadata())
    if (key != "format") metadata.emplace_back(key, value);
  std::set<std::string> written;
  std::string weight_map;
  const auto file_of = file_names(dir, files.size());
  for (size_t k = 0; k < files.size(); ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds(sleep_per_file_ms.load()));
    if (fail_after_files.load() == static_cast<int>(k))
      throw Error(dtrain::detail::cat("export_safetensors: stopped after ", k, " files (the test seam)"));
    const std::string& file = file_of[k];
    std::vector<st::Entry> entries;
    std::vector<at::Tensor> values;
    at::Tensor split;  // the entry of the last split name, read once for its indices
    std::string split_of;
    for (const auto& p : files[k]) {
      entries.push_back({p.name, to_file(p.info.name, p.info.dtype), p.shape(), 0, 0});
      if (p.index < 0) {
        values.push_back(saved.read(p.info).contiguous());
      } else {
        if (split_of != p.info.name) split = saved.read(p.info), split_of = p.info.name;
        values.push_back(split[p.index].contiguous());
      }
      weight_map += (weight_map.empty() ? "" : ",") + st::json_string(p.name) + ":" + st::json_string(file);
    }
    const std::string prefix = st::encode_prefix(entries, metadata);
    const uint64_t data = entries.empty() ? 0 : entries.back().end;
    dtrain::files::replace_durably(paths::join(dir, file), prefix.size() + data, [&](dtrain::files::Sink& out) {
      out.write(prefix.data(), prefix.size());
      for (const auto& v : values) out.write(v.data_ptr(), v.nbytes());
    });
    written.insert(file);
  }
  if (files.size() > 1) {
    const std::string index = "{\"metadata\":{\"total_size\":" + std::to_string(total) + "},\"weight_map\":{" +
                              weight_map + "}}\n";
    dtrain::files::replace_durably(paths::join(dir, "model.safetensors.index.json"), index.size(),
                           [&](dtrain::files::Sink& out) { out.write(index.data(), index.size()); });
    written.insert("model.safetensors.index.json");
  }
  for (const auto& file : paths::list(dir))
    if (is_output(file) && !written.count(file)) ::unlink(paths::join(dir, file).c_str());
}


}  // namespace dtrain::checkpoint::storage::safetensors_files

namespace dtrain::checkpoint::detail {
void stop_export_after_files(int files) { storage::safetensors_files::fail_after_files = files; }
void slow_export_files(std::chrono::milliseconds each) { storage::safetensors_files::sleep_per_file_ms = each.count(); }
}  // namespace dtrain::checkpoint::detail
