#include "common/env.h"

#include <cerrno>
#include <cstdlib>

#include "common/enforce.h"

namespace dtrain::env {

const Var kRank{"RANK", nullptr, "Global rank of this process (0..WORLD_SIZE-1)."};
const Var kWorldSize{"WORLD_SIZE", nullptr, "Number of ranks in the job."};
const Var kLocalRank{"LOCAL_RANK", nullptr,
                     "Rank of this process on its machine (set by launchers)."};
const Var kMasterAddr{"MASTER_ADDR", nullptr,
                      "Host of rank 0's TCP store for env:// (name or address)."};
const Var kMasterPort{"MASTER_PORT", nullptr, "Port of rank 0's TCP store for env://."};
const Var kUseAgentStore{
    "TORCHELASTIC_USE_AGENT_STORE", "False",
    "True when torchrun's agent already hosts the store on MASTER_PORT; ranks "
    "then connect to it as clients."};
const Var kRestartCount{"TORCHELASTIC_RESTART_COUNT", "0",
                        "Restart attempt number; store keys are scoped by it."};
const Var kOmpiRank{"OMPI_COMM_WORLD_RANK", nullptr, "Rank under mpirun (when RANK is unset)."};
const Var kOmpiSize{"OMPI_COMM_WORLD_SIZE", nullptr,
                    "World size under mpirun (when WORLD_SIZE is unset)."};
const Var kSlurmProcId{"SLURM_PROCID", nullptr, "Rank under srun (when RANK is unset)."};
const Var kSlurmStepNodelist{"SLURM_STEP_NODELIST", nullptr,
                             "The step's nodes under srun: its first is the rendezvous host "
                             "when MASTER_ADDR is unset."};
const Var kSlurmJobNodelist{"SLURM_JOB_NODELIST", nullptr,
                            "The job's nodes: used like SLURM_STEP_NODELIST when that is unset."};
const Var kSlurmJobId{"SLURM_JOB_ID", nullptr,
                      "With SLURM_STEP_ID, gives the rendezvous port when MASTER_PORT is unset."};
const Var kSlurmStepId{"SLURM_STEP_ID", nullptr, "The srun step's id (0 when unset)."};
const Var kSlurmNTasks{"SLURM_NTASKS", nullptr,
                       "World size under srun (when WORLD_SIZE is unset)."};
const Var kDebug{"DTRAIN_DEBUG", "OFF",
                 "OFF, INFO (log group creation and timings) or DETAIL (also "
                 "fingerprint every collective across ranks before it runs)."};
const Var kSocketIfname{"DTRAIN_SOCKET_IFNAME", nullptr,
                        "Network interface for the tcp backend's connections (e.g. eth0)."};
const Var kGlooSocketIfname{"GLOO_SOCKET_IFNAME", nullptr,
                            "PyTorch's name for DTRAIN_SOCKET_IFNAME, honoured when that is unset."};
const Var kTimeout{"DTRAIN_TIMEOUT", "1800",
                   "Default timeout in seconds of every blocking call when "
                   "InitOptions().timeout is not given."};

const Var kTty{"DTRAIN_TTY", "0",
               "Set to 1 by dtrain-run for workers whose output it shows on a terminal, so "
               "console_is_terminal() can choose a live progress bar."};

const Var kShmChunkBytes{"DTRAIN_SHM_CHUNK_BYTES", "auto",
                          "Bytes each rank of an shm group moves per step (its slot holds "
                          "two), or auto; read by group rank 0 when the group is created."};

const Var kShmDisable{"DTRAIN_SHM_DISABLE", "0",
                       "1: no shared memory between ranks: backend auto uses tcp for every "
                       "rank, also on one machine, and backend shm is refused."};

const Var kHostId{"DTRAIN_HOST_ID", nullptr,
                  "Splits one machine into separate hosts for dtrain: ranks with different "
                  "values never share memory (auto joins them over tcp); equal values never "
                  "join ranks of different machines."};

const Var kAlgo{"DTRAIN_ALGO", "auto",
                "all_reduce's algorithm on tcp and on auto across hosts: auto, ring, "
                "recursive_doubling or two_level; one that cannot run on a group leaves "
                "the choice to auto there."};

const Var kCpuMemory{"DTRAIN_CPU_MEMORY", "cache",
                     "cache: freed CPU tensor memory stays in the process for the next step "
                     "(malloc keeps blocks below 1 GiB, 32 MiB on older glibc, and never trims; "
                     "thresholds set with MALLOC_*_ or GLIBC_TUNABLES stay in force); system: "
                     "malloc as configured."};

const Var kTcpStreams{"DTRAIN_TCP_STREAMS", "auto",
                      "TCP connections between each pair of ranks of a tcp group (1..16, or "
                      "auto: 2 on machines with more than 4 cores, else 1); messages of "
                      "256 KiB and more are split over all of them."};

const Var kTcpUnexpectedBytes{
    "DTRAIN_TCP_UNEXPECTED_BYTES", "67108864",
    "Memory a rank of a tcp group holds at most for messages that arrive before their receive is "
    "posted, in bytes (at least 65536), shared over its connections (each at least 4 KiB); a "
    "larger message is announced and sent once its receive is posted."};

const Var kTcpUnexpectedMessages{
    "DTRAIN_TCP_UNEXPECTED_MESSAGES", "65536",
    "Announced messages (those beyond DTRAIN_TCP_UNEXPECTED_BYTES) a rank of a tcp group holds "
    "at most before their receive is posted, over all its connections (about 256 bytes each, "
    "at least 1024); a peer that announces more fails the group naming this cap."};

const Var kStoreMaxBytes{"DTRAIN_STORE_MAX_BYTES", "1073741824",
                         "Cap on the keys and values a TCP store hosted by this process holds, "
                         "in bytes (at least 1048576); a set() that would pass it fails with an "
                         "error naming it."};
const Var kStoreMaxKeys{"DTRAIN_STORE_MAX_KEYS", "1048576",
                        "Cap on the number of keys a TCP store hosted by this process holds "
                        "(at least 1024)."};

const Var kStoreToken{"DTRAIN_STORE_TOKEN", nullptr,
                      "The job token: a TCP store serves only connections that prove they hold "
                      "it (HMAC-SHA256 challenge and response); set the same value for every "
                      "rank and launcher of the job."};
const Var kStoreTokenFile{"DTRAIN_STORE_TOKEN_FILE", nullptr,
                          "A file holding the job token instead (readable by its owner only)."};

const Var kLauncher{"DTRAIN_LAUNCHER", nullptr,
                    "Set to dtrain-run by dtrain-run for its workers: its agent store then "
                    "speaks dtrain's own protocol to them, which proves the job token."};

const Var kTraceDir{"DTRAIN_TRACE_DIR", nullptr,
                    "Directory for flight recorder dumps (rank-R.json): written on the first "
                    "failed operation, on SIGUSR2 and on dump_flight_recorder()."};

const Var kTraceBufferSize{"DTRAIN_TRACE_BUFFER_SIZE", "2000",
                           "Operations each process group's flight recorder keeps (0: off)."};

const Var kErrorFile{"TORCHELASTIC_ERROR_FILE", nullptr,
                     "Set by dtrain-run and torchrun, one per worker: where the worker writes why it "
                     "failed (JSON, torchrun's format); dtrain::record_error and the terminate "
                     "handler init_process_group installs write it, the launcher's failure summary "
                     "shows it."};
const Var kTimeline{"DTRAIN_TIMELINE", nullptr,
                    "Path of a Chrome-trace timeline: each rank writes PATH.rank-R.json, "
                    "dtrain-run merges them into PATH."};

const Var kSnapshotSocket{"DTRAIN_SNAPSHOT_SOCKET", nullptr,
                          "Set by dtrain-run for its workers: the Unix socket of its snapshot "
                          "keeper, which holds checkpoint::snapshot()'s parts outside the workers."};
const Var kSnapshotMemory{"DTRAIN_SNAPSHOT_MEMORY", nullptr,
                          "Bytes (K, M, G suffixes) dtrain-run's snapshot keeper holds at most; "
                          "unset: half of the host's memory."};
const Var kFtLighthouse{"DTRAIN_FT_LIGHTHOUSE", nullptr,
                        "host:port of the fault-tolerant job's lighthouse, where ft::Manager "
                        "asks for each step's quorum (torchft's TORCHFT_LIGHTHOUSE)."};
const Var kFtReplicaId{"DTRAIN_FT_REPLICA_ID", nullptr,
                       "This replica group's id in a fault-tolerant job, the same on each of its "
                       "ranks and across its restarts (torchft's REPLICA_GROUP_ID)."};

const std::vector<const Var*>& all() {
  static const std::vector<const Var*> vars{
      &kRank,      &kWorldSize, &kLocalRank,    &kMasterAddr,   &kMasterPort,
      &kUseAgentStore, &kRestartCount, &kOmpiRank, &kOmpiSize, &kSlurmProcId,
      &kSlurmNTasks, &kSlurmStepNodelist, &kSlurmJobNodelist, &kSlurmJobId, &kSlurmStepId, &kDebug,   &kSocketIfname, &kGlooSocketIfname, &kTimeout, &kTty,
      &kShmChunkBytes, &kShmDisable, &kHostId, &kAlgo, &kCpuMemory, &kTcpStreams, &kTcpUnexpectedBytes, &kTcpUnexpectedMessages, &kStoreMaxBytes, &kStoreMaxKeys,
      &kStoreToken, &kStoreTokenFile, &kLauncher, &kTraceDir, &kTraceBufferSize, &kTimeline, &kErrorFile,
      &kSnapshotSocket, &kSnapshotMemory, &kFtLighthouse, &kFtReplicaId};
  return vars;
}

std::optional<std::string> get(const Var& var) {
  if (const char* v = std::getenv(var.name)) return std::string(v);
  if (var.default_value) return std::string(var.default_value);
  return std::nullopt;
}

std::optional<long long> get_int(const Var& var, long long lo, long long hi) {
  auto text = get(var);
  if (!text) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  long long value = std::strtoll(text->c_str(), &end, 10);
  DTRAIN_CHECK_ARG(!text->empty() && end && *end == '\0' && errno == 0,
                   "environment variable ", var.name, "='", *text,
                   "' is not an integer");
  DTRAIN_CHECK_ARG(value >= lo && value <= hi, "environment variable ", var.name,
                   "=", value, " is out of range (expected ", lo, "..", hi, ")");
  return value;
}

}  // namespace dtrain::env
