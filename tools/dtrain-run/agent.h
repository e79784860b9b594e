#pragma once

#include "options.h"

namespace dtrain::run {

// Runs the job on this node until it succeeds (returns 0), fails with no
// restarts left (prints a summary, returns 1), or the launcher is signalled
// (stops the workers, returns 128 + signal).
int run_agent(const Options& options);

}  // namespace dtrain::run
