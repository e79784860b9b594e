#pragma once

// DTRAIN_TIMELINE=PATH: each worker writes PATH.rank-R.json (trace events,
// one per line); after its workers end, dtrain-run merges this node's into
// PATH, one Chrome-trace file with a track group per rank.

#include <string>
#include <vector>

namespace dtrain::run {

// Merges the parts of `ranks` that exist into `path` (written atomically:
// a temporary file renamed over it) and removes them. Returns the ranks
// merged; throws std::runtime_error naming the file on an I/O failure.
std::vector<int> merge_timeline(const std::string& path, const std::vector<int>& ranks);

}  // namespace dtrain::run
