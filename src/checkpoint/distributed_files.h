#pragma once

// The files of a distributed checkpoint, shared by its writer
// (distributed_save.cpp) and its reader (distributed_load.cpp):
//
//   <dir>/data-<token>-<rank>.dtt   a rank's tensors: "r/<name>" (replicated
//                                   entries assigned to it), "s/<name>" (its
//                                   piece of a sharded entry; file metadata
//                                   "offset/<name>" says where it lies)
//   <dir>/metadata.dtt              written last, atomically, by rank 0:
//                                   the token, the world size, where each
//                                   replicated entry is, each sharded
//                                   entry's size, the user's metadata ("u/")

#include <string>

#include "common/enforce.h"
#include "common/paths.h"
#include "dtrain/checkpoint/distributed.h"

namespace dtrain::checkpoint::files {

inline constexpr const char* kFormat = "dtrain distributed checkpoint 1";
inline constexpr const char* kMetadataFile = "metadata.dtt";

inline std::string data_file(const std::string& dir, const std::string& token, int rank) {
  return paths::join(dir, "data-" + token + "-" + std::to_string(rank) + ".dtt");
}

// A non-negative decimal count of at most 19 digits, or InvalidArgument
// naming `what`.
inline int64_t parse_count(const std::string& what, const std::string& text) {
  DTRAIN_CHECK_ARG(!text.empty() && text.size() < 20 &&
                       text.find_first_not_of("0123456789") == std::string::npos,
                   what, " is not a count: '", text, "'");
  return std::stoll(text);
}

// What save and load both check of a state before touching any file.
inline void check_local(const DistributedState& state) {
  for (const auto& [name, t] : state.replicated)
    DTRAIN_CHECK_ARG(t.defined(), "checkpoint: replicated '", name, "' is undefined");
  for (const auto& [name, s] : state.sharded) {
    DTRAIN_CHECK_ARG(s.local.defined() && s.local.is_contiguous(), "checkpoint: sharded '", name,
                     "' has no contiguous local tensor");
    DTRAIN_CHECK_ARG(s.offset >= 0 && s.offset + s.local.numel() <= s.numel, "checkpoint: sharded '",
                     name, "' holds elements [", s.offset, ", ", s.offset + s.local.numel(),
                     ") of ", s.numel);
  }
}

}  // namespace dtrain::checkpoint::files
