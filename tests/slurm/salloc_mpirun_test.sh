#!/usr/bin/env bash
# mpirun inside salloc -N2 -n4 under a real two-node Slurm: Debian's
# OpenMPI takes the allocation from Slurm and the mpi backend's exactness
# matrix passes on all 4 ranks.
#   salloc_mpirun_test.sh MPIRUN RANK_WORKER
set -eu
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/expect_ranks.sh" "matrix ok on mpi" salloc -N2 -n4 --immediate=30 --time=2 \
  "$1" --allow-run-as-root --oversubscribe -x DTRAIN_TIMEOUT=60 "$2" matrix mpi
echo "slurm: mpirun under salloc, 4 ranks on the mpi backend"
