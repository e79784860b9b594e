#pragma once

// dtrain-run --replicas R: the replica groups of a fault-tolerant job
// (dtrain/ft/manager.h, docs/fault-tolerance.md) on this node, from one
// command. Each replica is a dtrain-run of its own (this program again,
// --standalone, with DTRAIN_FT_REPLICA_ID=replica-<k>), so a failure
// restarts only that replica's workers, within its own --max-restarts, and
// the others never stop. A lighthouse is served from this process unless
// DTRAIN_FT_LIGHTHOUSE names one; the job token (made here unless set) is
// the lighthouse's and every replica's. Each line a replica prints is
// passed on prefixed with its id.

#include "options.h"

namespace dtrain::run {

// Runs the replicas until every one has exited: 0 when all succeeded, 1
// when one failed (each failure named; the others ran on to their end),
// 128 + signal when this launcher was signalled (the signal is passed on
// to every replica's launcher, which stops its workers).
int run_replicas(const Options& options);

}  // namespace dtrain::run
