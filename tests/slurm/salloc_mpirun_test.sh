#!/usr/bin/env bash
# mpirun inside salloc under a real Slurm: Debian's OpenMPI takes the
# allocation from Slurm and the mpi backend's exactness matrix passes on all
# 4 ranks. 4 ranks on this machine's cores need --oversubscribe, and, for
# Open MPI 5 (which binds to cores by default and then finds no core left),
# --bind-to none.
#
# Open MPI 4 (Debian 12) runs them on both nodes (-N2). Open MPI 5 (Debian 13
# and unstable) takes the two nodes, which are this one machine at
# 127.0.0.1, for two hosts and will not join them over loopback ("Unable to
# find reachable pairing between local and remote interfaces"), so there the
# allocation is one node (-N1): still Slurm's, still read by mpirun.
#   salloc_mpirun_test.sh MPIRUN RANK_WORKER
set -eu
here=$(cd "$(dirname "$0")" && pwd)
major=$("$1" --version 2>/dev/null | sed -n 's/.*Open MPI[^0-9]*\([0-9][0-9]*\)\..*/\1/p' | head -1)
nodes=2
if [ "${major:-4}" -ge 5 ]; then nodes=1; fi
bash "$here/expect_ranks.sh" "matrix ok on mpi" salloc -N$nodes -n4 --immediate=30 --time=2 \
  "$1" --allow-run-as-root --oversubscribe --bind-to none -x DTRAIN_TIMEOUT=60 "$2" matrix mpi
echo "slurm: mpirun (Open MPI ${major:-?}) under salloc -N$nodes, 4 ranks on the mpi backend"
