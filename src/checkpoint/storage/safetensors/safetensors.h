#pragma once

// The safetensors storage: Hugging Face's files, written whole from a
// committed checkpoint (export_safetensors converts a staging directory
// checkpoint on rank 0) and read into any layout's pieces, each rank only
// its own bytes (import_safetensors).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "checkpoint/storage/storage.h"

namespace dtrain::checkpoint::storage::safetensors_files {

// A state entry's name in the files; "" leaves the entry out.
using Rename = std::function<std::string(const std::string&)>;

// add_module's parameters and buffers under their module names, a
// GroupedExperts' w1, w3 and w2 as Hugging Face's per-expert
// "experts.{e}.gate_proj.weight", "up_proj" and "down_proj"; nothing else.
std::string default_rename(const std::string& entry);

// A name in the files with this mark splits its entry along the first
// dimension: one tensor per index, the mark replaced by the index.
inline constexpr const char* kIndexMark = "{e}";
// `name` with its index mark replaced by `index`.
std::string indexed(const std::string& name, int64_t index);

// `saved`'s entries whole into files of at most `max_bytes` of tensors
// each, the index beside them when there are several, then the earlier
// export's other files removed. The set changes at one rename: a single
// file replaces "model.safetensors" atomically, and several are written
// under names no earlier file has, then the index that names them replaces
// the earlier index. A crash before that leaves the earlier export as its
// index names it (Hugging Face's loaders read that; the reader, reading
// every file, names the tensor that two files hold).
void write_export(const std::string& dir, WholeEntries& saved, const Rename& rename, int64_t max_bytes);

// Not collective: the files of `dir` read into a state's entries (renamed).
std::unique_ptr<Reader> reader(const std::string& dir, Rename rename);

}  // namespace dtrain::checkpoint::storage::safetensors_files
