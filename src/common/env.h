#pragma once

// The one registry of environment variables dtrain reads. Each variable is
// declared once in env.cpp with its default and a doc line; docs/env-vars.md
// lists them all (a unit test checks that the two agree). Nothing else in
// dtrain calls getenv().

#include <optional>
#include <string>
#include <vector>

namespace dtrain::env {

struct Var {
  const char* name;
  const char* default_value;  // nullptr: no default
  const char* doc;
};

// Worker contract (torchrun's names).
extern const Var kRank, kWorldSize, kLocalRank, kMasterAddr, kMasterPort;
extern const Var kUseAgentStore, kRestartCount, kErrorFile;
// Schedulers, read when RANK/WORLD_SIZE are absent.
extern const Var kOmpiRank, kOmpiSize, kSlurmProcId, kSlurmNTasks;
// Slurm, read by env:// when MASTER_ADDR / MASTER_PORT are absent.
extern const Var kSlurmStepNodelist, kSlurmJobNodelist, kSlurmJobId, kSlurmStepId;
// dtrain's own.
extern const Var kDebug, kSocketIfname, kGlooSocketIfname, kTimeout, kTty;
extern const Var kShmChunkBytes, kShmDisable, kHostId, kAlgo, kCpuMemory, kTcpStreams, kTcpUnexpectedBytes, kTcpUnexpectedMessages, kStoreMaxBytes, kStoreMaxKeys,
    kStoreToken, kStoreTokenFile, kLauncher, kTraceDir, kTraceBufferSize, kTimeline;
// Snapshots in memory (checkpoint/snapshot.h, dtrain-run's keeper).
extern const Var kSnapshotSocket, kSnapshotMemory;
// Fault tolerance (ft/manager.h).
extern const Var kFtLighthouse, kFtReplicaId;

const std::vector<const Var*>& all();

// The raw value, unset -> default (which may be nullopt).
std::optional<std::string> get(const Var& var);

// Integer value; a value that is not an integer, or outside [lo, hi],
// throws InvalidArgument naming the variable and the value.
std::optional<long long> get_int(const Var& var, long long lo, long long hi);

}  // namespace dtrain::env
