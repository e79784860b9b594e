#!/usr/bin/env bash
# mpirun inside salloc -N2 -n4 under a real two-node Slurm: Debian's
# OpenMPI takes the allocation from Slurm and the mpi backend's exactness
# matrix passes on all 4 ranks. Both nodes are this machine (127.0.0.1):
# 4 ranks on its cores need --oversubscribe and, for Open MPI 5 (which binds
# to cores by default and then finds no core left), --bind-to none; Open
# MPI 5 takes n1 and n2 for two hosts and joins them over TCP, which must be
# allowed onto loopback (excluded by default).
#   salloc_mpirun_test.sh MPIRUN RANK_WORKER
set -eu
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/expect_ranks.sh" "matrix ok on mpi" salloc -N2 -n4 --immediate=30 --time=2 \
  "$1" --allow-run-as-root --oversubscribe --bind-to none \
  --mca btl_tcp_if_include lo -x DTRAIN_TIMEOUT=60 "$2" matrix mpi
echo "slurm: mpirun under salloc, 4 ranks on the mpi backend"
