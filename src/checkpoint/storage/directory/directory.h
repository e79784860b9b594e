#pragma once

// The directory storage: a distributed checkpoint as tensor files on a
// file system every rank reaches (layout.h), written by save() and
// async_save(), read at any world size by load(), whole by a conversion
// (export_safetensors).

#include <memory>
#include <string>

#include "checkpoint/storage/storage.h"
#include "dtrain/checkpoint/tensor_file.h"

namespace dtrain::checkpoint::storage::directory {

// `what` is "checkpoint::save" or "checkpoint::async_save" (its errors
// start with "<what> <dir>"). Test hooks: `faults` for this rank's data
// file; `die_before_commit`: rank 0 dies once every data file is written.
std::unique_ptr<Writer> writer(const std::string& dir, const std::string& what, const WriteFaults& faults = {},
                               bool die_before_commit = false);
// Not collective; reshards (each rank reads the pieces that overlap what
// it holds).
std::unique_ptr<Reader> reader(const std::string& dir);
// Each entry whole, whatever layout saved it (flat ranges refused by name).
std::unique_ptr<WholeEntries> whole_entries(const std::string& dir);

}  // namespace dtrain::checkpoint::storage::directory
