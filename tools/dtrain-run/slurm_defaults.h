#pragma once

// `srun --ntasks-per-node=1 dtrain-run ...`: one launcher per Slurm node.

#include <string>

namespace dtrain::run {

// When every Slurm task of the step is a launcher on a node of its own
// (SLURM_NTASKS equals SLURM_NNODES), sets PET_NNODES, PET_NODE_RANK,
// PET_MASTER_ADDR and PET_MASTER_PORT from Slurm unless they are set, so
// flags not given on the command line take them (flags given still win):
// the nodes, this node's id, the step's first node (at the address Slurm
// knows when its name does not resolve) and a port from the job and step
// ids. Returns what it set, for a log line ("" when not under such a step).
// Throws std::runtime_error for a malformed nodelist.
std::string apply_slurm_defaults();

}  // namespace dtrain::run
