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

// add_module's parameters and buffers under their module names; nothing else.
std::string default_rename(const std::string& entry);

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
