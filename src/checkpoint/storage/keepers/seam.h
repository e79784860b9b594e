#pragma once

// Test seam of checkpoint::snapshot (not public): the group rank whose
// commit its keeper refuses, once every part is kept; -1: none (the default).

namespace dtrain::checkpoint::detail {
void refuse_snapshot_commit_on(int rank);
}  // namespace dtrain::checkpoint::detail
