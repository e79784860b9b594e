#pragma once

// The files of a distributed checkpoint, shared by its writer
// (writer.cpp) and its reader (reader.cpp):
//
//   <dir>/data-<token>-<rank>.dtt   a rank's tensors: "r/<name>" (replicated
//                                   entries assigned to it), "s/<name>" (its
//                                   piece of a sharded entry; file metadata
//                                   "offset/<name>" says where it lies)
//   <dir>/metadata.dtt              written last, atomically, by rank 0:
//                                   the token, the world size, where each
//                                   replicated entry is, each sharded
//                                   entry's size (and whole shape: "shape/"
//                                   of boxes, "flat_shape/" of flat ranges
//                                   that say theirs), the user's metadata ("u/")

#include <string>
#include <vector>

#include "common/decimal.h"
#include "common/enforce.h"
#include "common/error_text.h"
#include "common/paths.h"
#include "checkpoint/state/check.h"
#include "dtrain/checkpoint/distributed.h"

namespace dtrain::checkpoint::files {

using dtrain::detail::error_of;
using state_checks::check_local;
using state_checks::shape_text;

inline constexpr const char* kFormat = "dtrain distributed checkpoint 1";
inline constexpr const char* kMetadataFile = "metadata.dtt";

inline std::string data_file(const std::string& dir, const std::string& token, int rank) {
  return paths::join(dir, "data-" + token + "-" + std::to_string(rank) + ".dtt");
}

// A non-negative decimal count that fits in int64_t, or InvalidArgument
// naming `what`.
inline int64_t parse_count(const std::string& what, const std::string& text) {
  const auto v = dtrain::detail::parse_decimal(text);
  DTRAIN_CHECK_ARG(v.has_value(), what, " is not a count: '", text, "'");
  return *v;
}

// "a,b,c" of a list of counts.
inline std::string join_counts(const std::vector<int64_t>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + std::to_string(v[i]);
  return out;
}

// The counts of "a,b,c" (at most 64 of them), or InvalidArgument naming `what`.
inline std::vector<int64_t> parse_counts(const std::string& what, const std::string& text) {
  std::vector<int64_t> out;
  size_t at = 0;
  while (out.size() <= 64) {
    const size_t comma = text.find(',', at);
    out.push_back(parse_count(what, text.substr(at, comma == std::string::npos ? std::string::npos : comma - at)));
    if (comma == std::string::npos) return out;
    at = comma + 1;
  }
  DTRAIN_CHECK_ARG(false, what, " has more than 64 dimensions");
  return out;
}

}  // namespace dtrain::checkpoint::files
