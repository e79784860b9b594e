#pragma once

// What every save and load checks of a state before touching any storage:
// its tensors defined, its pieces contiguous and inside their wholes.

#include <string>
#include <vector>

#include "common/enforce.h"
#include "dtrain/checkpoint/distributed.h"

namespace dtrain::checkpoint::state_checks {

// "[a, b, c]", as torch prints sizes.
inline std::string shape_text(const std::vector<int64_t>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return "[" + out + "]";
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
    if (s.flat_shape.empty()) continue;
    int64_t numel = 1;
    for (int64_t d : s.flat_shape) numel *= d;
    DTRAIN_CHECK_ARG(numel == s.numel, "checkpoint: sharded '", name, "' says ", s.numel,
                     " elements, but its whole's shape ", shape_text(s.flat_shape), " has ", numel);
  }
}

}  // namespace dtrain::checkpoint::state_checks
