// export_safetensors and import_safetensors (dtrain/checkpoint/safetensors.h):
// Hugging Face's files written from a distributed checkpoint read whole,
// and read into any layout's pieces.

#include "dtrain/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "checkpoint/distributed_files.h"
#include "checkpoint/export_seam.h"
#include "checkpoint/rank0_step.h"
#include "checkpoint/safetensors_reader.h"
#include "checkpoint/safetensors_format.h"
#include "checkpoint/whole_entries.h"
#include "common/durable_file.h"
#include "common/enforce.h"
#include "common/paths.h"
#include "dtrain/distributed.h"
#include "dtrain/objects.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian, as this host");

namespace dtrain::checkpoint {
namespace {

namespace st = safetensors;
using Rename = std::function<std::string(const std::string&)>;
using files::error_of;

st::DType to_file(const std::string& name, at::ScalarType type) { return detail::file_type(name, type); }

// add_module's parameters and buffers under their module names; nothing else.
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

void make_dirs(const std::string& dir) {
  for (size_t slash = dir.find('/', 1);; slash = dir.find('/', slash + 1)) {
    const std::string prefix = dir.substr(0, slash);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST)
      throw Error("cannot create directory " + prefix + ": " + std::strerror(errno));
    if (slash == std::string::npos) break;
  }
  DTRAIN_CHECK_ARG(paths::is_directory(dir), dir, " is not a directory");
}

bool is_output(const std::string& file) {
  auto ends = [&](const std::string& end) {
    return file.size() >= end.size() && file.compare(file.size() - end.size(), end.size(), end) == 0;
  };
  return file.rfind("model", 0) == 0 && (ends(".safetensors") || file == "model.safetensors.index.json");
}

struct Planned {
  detail::EntryInfo info;
  std::string name;  // in the file
  uint64_t bytes = 0;
};

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

// Rank 0: the staged checkpoint's entries, whole, into files of at most
// `max_bytes` of tensors each, the index beside them when there are
// several; then the earlier export's other files and the staging removed.
// The set changes at one rename: a single file replaces "model.safetensors"
// atomically, and several are written under names no earlier file has,
// then the index that names them replaces the earlier index. A crash
// before that leaves the earlier export as its index names it (Hugging
// Face's loaders read that; import_safetensors, reading every file, names
// the tensor that two files hold).
void write_files(const std::string& dir, const std::string& staging, const Rename& rename, int64_t max_bytes) {
  detail::WholeEntries saved(staging);
  std::vector<std::vector<Planned>> files(1);
  std::set<std::string> names;
  uint64_t in_file = 0, total = 0;
  for (auto& info : saved.entries()) {
    Planned p{info, rename(info.name), 0};
    DTRAIN_CHECK_ARG(names.insert(p.name).second, "export_safetensors: two entries are named '", p.name,
                     "' in the files (the last one is '", info.name, "')");
    st::Entry probe{p.name, to_file(info.name, info.dtype), info.shape, 0, 0};
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
  std::vector<std::pair<std::string, std::string>> metadata{{"format", "pt"}};
  for (const auto& [key, value] : saved.user_metadata())
    if (key.rfind("u/", 0) == 0 && key != "u/format") metadata.emplace_back(key.substr(2), value);
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
    for (const auto& p : files[k]) {
      entries.push_back({p.name, to_file(p.info.name, p.info.dtype), p.info.shape, 0, 0});
      values.push_back(saved.read(p.info).contiguous());
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
  paths::remove_all(staging);
}

}  // namespace

void export_safetensors(const std::string& dir, const DistributedState& state, const SafetensorsOptions& options) {
  auto group = options.process_group() ? options.process_group() : default_group();
  DTRAIN_CHECK_ARG(group && group->rank() >= 0, "export_safetensors: this rank is not in the group");
  DTRAIN_CHECK_ARG(options.max_shard_bytes() > 0, "export_safetensors: max_shard_bytes must be positive, got ",
                   options.max_shard_bytes());
  const Rename rename = options.rename() ? options.rename() : Rename(default_rename);
  DistributedState chosen;
  for (const auto& [name, t] : state.replicated)
    if (!rename(name).empty()) chosen.replicated[name] = t;
  for (const auto& [name, s] : state.sharded)
    if (!rename(name).empty()) chosen.sharded[name] = s;
  chosen.metadata = state.metadata;
  chosen.before_save = state.before_save;  // gathers of FSDP's shards: the values of now
  const std::string context = "export_safetensors " + dir;
  auto together = [&](const std::string& error) {
    try {
      fail_together(*group, error);
    } catch (const Error& e) {
      throw Error(context + ": " + e.what());
    }
  };
  together(group->rank() == 0 ? error_of([&] { make_dirs(dir); }) : "");
  const std::string staging = paths::join(dir, ".dtrain-export");
  save(staging, chosen, SaveOptions().process_group(group));
  // The others wait for rank 0's word, not under a deadline on the whole
  // conversion (checkpoint/rank0_step.h).
  together(detail::run_on_rank0(*group, context, [&] {
    return error_of([&] { write_files(dir, staging, rename, options.max_shard_bytes()); });
  }));
}

namespace detail {
void stop_export_after_files(int files) { fail_after_files = files; }
void slow_export_files(std::chrono::milliseconds each) { sleep_per_file_ms = each.count(); }
}  // namespace detail

void import_safetensors(const std::string& dir, DistributedState& state, const SafetensorsOptions& options) {
  const Rename rename = options.rename() ? options.rename() : Rename(default_rename);
  detail::SafetensorsFiles files(dir);
  // Everything is read and checked before any entry changes; each entry
  // reads only its own part of its tensor.
  std::vector<std::pair<at::Tensor, at::Tensor>> fills;  // {destination, values}
  for (auto& [name, t] : state.replicated) {
    const std::string in_file = rename(name);
    if (in_file.empty()) continue;
    const auto shape = t.sizes().vec();
    fills.emplace_back(t, files.read_box(in_file, name, t.scalar_type(), shape, std::vector<int64_t>(shape.size(), 0),
                                         t.sizes()));
  }
  for (auto& [name, s] : state.sharded) {
    const std::string in_file = rename(name);
    if (in_file.empty()) continue;
    if (s.is_box())
      fills.emplace_back(s.local, files.read_box(in_file, name, s.local.scalar_type(), s.shape, s.offsets, s.local.sizes()));
    else  // a flat range of a tensor whose shape the file gives
      fills.emplace_back(s.local, files.read_range(in_file, name, s.local.scalar_type(), s.numel, s.offset,
                                                   s.local.numel()));
  }
  {
    at::NoGradGuard no_grad;
    for (auto& [to, from] : fills) to.detach().view({-1}).copy_(from.reshape({-1}));
  }
  for (const auto& hook : state.after_load) hook();
}

}  // namespace dtrain::checkpoint
