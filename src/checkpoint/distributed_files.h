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

#include <exception>
#include <string>
#include <vector>

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

// Runs `step`, turning what it throws into this rank's error text ("" when
// it succeeds), for dtrain::fail_together.
template <typename Step>
std::string error_of(Step&& step) {
  try {
    step();
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

// "a,b,c" of a list of counts.
inline std::string join_counts(const std::vector<int64_t>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + std::to_string(v[i]);
  return out;
}

// "[a, b, c]", as torch prints sizes.
inline std::string shape_text(const std::vector<int64_t>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return "[" + out + "]";
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

// A box piece lies inside its whole, whose size it states.
inline void check_box(const std::string& name, const ShardedTensor& s) {
  const auto& t = s.local;
  DTRAIN_CHECK_ARG(s.offsets.size() == s.shape.size() && t.dim() == static_cast<int64_t>(s.shape.size()),
                   "checkpoint: sharded '", name, "' is a box of a whole of shape ", shape_text(s.shape),
                   " with offsets ", shape_text(s.offsets), " and a local tensor of shape ", t.sizes());
  int64_t numel = 1;
  for (size_t d = 0; d < s.shape.size(); ++d) {
    DTRAIN_CHECK_ARG(s.offsets[d] >= 0 && s.offsets[d] + t.size(d) <= s.shape[d], "checkpoint: sharded '",
                     name, "' holds [", s.offsets[d], ", ", s.offsets[d] + t.size(d), ") of dimension ", d,
                     " of a whole of shape ", shape_text(s.shape));
    numel *= s.shape[d];
  }
  DTRAIN_CHECK_ARG(numel == s.numel, "checkpoint: sharded '", name, "' says ", s.numel,
                   " elements, but its whole's shape ", shape_text(s.shape), " has ", numel);
}

// What save and load both check of a state before touching any file.
inline void check_local(const DistributedState& state) {
  for (const auto& [name, t] : state.replicated)
    DTRAIN_CHECK_ARG(t.defined(), "checkpoint: replicated '", name, "' is undefined");
  for (const auto& [name, s] : state.sharded) {
    DTRAIN_CHECK_ARG(s.local.defined() && s.local.is_contiguous(), "checkpoint: sharded '", name,
                     "' has no contiguous local tensor");
    if (s.is_box()) {
      check_box(name, s);
      continue;
    }
    DTRAIN_CHECK_ARG(s.offset >= 0 && s.offset + s.local.numel() <= s.numel, "checkpoint: sharded '",
                     name, "' holds elements [", s.offset, ", ", s.offset + s.local.numel(),
                     ") of ", s.numel);
  }
}

}  // namespace dtrain::checkpoint::files
