#pragma once

// A committed distributed checkpoint's entries read whole, whatever layout
// saved them (replicated, or boxes of a whole): export_safetensors reads
// its staging checkpoint this way (distributed_load.cpp).

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dtrain::checkpoint::detail {

struct EntryInfo {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

class WholeEntries {
 public:
  explicit WholeEntries(const std::string& dir);
  ~WholeEntries();
  WholeEntries(const WholeEntries&) = delete;
  WholeEntries& operator=(const WholeEntries&) = delete;

  // Every entry in name order, without reading values; an entry saved as
  // flat ranges is an InvalidArgument naming it.
  std::vector<EntryInfo> entries();
  // One entry, whole (a CPU tensor).
  at::Tensor read(const EntryInfo& entry);
  // The metadata file's keys ("u/<key>": the user's).
  const std::map<std::string, std::string>& user_metadata() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::checkpoint::detail
