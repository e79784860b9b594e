#!/usr/bin/env bash
# mpirun inside salloc -N2 -n4 under a real two-node Slurm
# (slurm_cluster.sh): Debian's OpenMPI takes the allocation from Slurm and
# the mpi backend's exactness matrix passes on all 4 ranks.
#   salloc_mpirun_test.sh MPIRUN RANK_WORKER
set -u
mpirun=$1 worker=$2
here=$(cd "$(dirname "$0")" && pwd)
out=$(bash "$here/slurm_cluster.sh" salloc -N2 -n4 --immediate=30 --time=2 \
  "$mpirun" --allow-run-as-root --oversubscribe -x DTRAIN_TIMEOUT=60 "$worker" matrix mpi 2>&1)
rc=$?
echo "$out"
[ "$rc" -eq 0 ] || { echo "slurm: mpirun under salloc failed (exit $rc)"; exit 1; }
for r in 0 1 2 3; do
  grep -q "rank $r matrix ok on mpi" <<<"$out" || { echo "slurm: rank $r did not finish"; exit 1; }
done
echo "slurm: mpirun under salloc, 4 ranks on the mpi backend"
