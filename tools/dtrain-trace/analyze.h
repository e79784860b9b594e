#pragma once

// The verdict on a set of flight recorder dumps: which rank called a
// different collective, which never arrived, which is behind, and where
// each rank failed.

#include <map>
#include <string>
#include <vector>

#include "dumps.h"

namespace dtrain::trace {

struct Report {
  std::string verdict;                // one line, naming the rank and the op at fault
  std::vector<std::string> findings;  // every observation, group by group
};

Report analyze(const std::map<int, Dump>& dumps);
// The same with partial evidence: incomplete dumps are used as dumps; a
// rank with no dump but an error file saying where it failed counts as
// having reached that collective (failed), not as absent.
Report analyze(const Evidence& evidence);

}  // namespace dtrain::trace
