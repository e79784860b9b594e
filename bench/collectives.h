#pragma once

#include "bench_util.h"

namespace dtrain::bench {

// dtrain-bench collectives: nccl-tests-style table for one collective on the
// default group of a job started by dtrain-run (see collectives.cpp).
int bench_collectives(const Args& args);

}  // namespace dtrain::bench
