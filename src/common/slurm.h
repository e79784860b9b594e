#pragma once

// Slurm's environment for env:// without MASTER_ADDR/MASTER_PORT: the
// rendezvous host is the first node of the step (SLURM_STEP_NODELIST, else
// SLURM_JOB_NODELIST, hostlist expressions such as "n[1-2]" or
// "gpu-[01-03,07]"), the port is derived from the job and step ids.

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::slurm {

// The hosts of a Slurm hostlist, in order: comma-separated names, each with
// bracketed ranges and numbers ("[01-03,07]", zero padding kept, several
// brackets per name allowed). At most `max_hosts` are produced (the rest
// are dropped). Throws InvalidArgument naming `what` on a malformed list.
std::vector<std::string> expand_hostlist(const std::string& list, const std::string& what,
                                         size_t max_hosts = 1 << 16);

// A port for the job's rendezvous: 15000 + (job * 1009 + step) mod 40000,
// so the steps of one job get different ports (up to 40000 of them).
int rendezvous_port(long long job_id, long long step_id);

// The rendezvous endpoint Slurm's variables give when MASTER_ADDR or
// MASTER_PORT is unset: the first node of the step's (else the job's)
// nodelist, the port from SLURM_JOB_ID and SLURM_STEP_ID (0 when unset).
// Nullopt for a part Slurm does not give.
std::optional<std::string> master_addr_from_slurm();
// The address Slurm knows for `node` (NodeAddr of `scontrol show node`,
// asked with a 5 s limit): for node names that do not resolve. Nullopt
// when scontrol is missing, fails, or the name is not a plain host name.
std::optional<std::string> node_addr(const std::string& node);
std::optional<int> master_port_from_slurm();

}  // namespace dtrain::slurm
