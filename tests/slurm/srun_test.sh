#!/usr/bin/env bash
# srun -N2 -n4 of rank_worker's collectives under a real two-node Slurm,
# with no MASTER_ADDR, MASTER_PORT, RANK or WORLD_SIZE: rank and world come
# from SLURM_PROCID/SLURM_NTASKS, the rendezvous host from
# SLURM_STEP_NODELIST's first node (n1, which is not in DNS: its NodeAddr
# from scontrol), the port from the job and step ids.
#   srun_test.sh RANK_WORKER
set -eu
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/expect_ranks.sh" ok srun -N2 -n4 --immediate=30 --time=2 --kill-on-bad-exit=1 \
  "$1" collectives
echo "slurm: 4 ranks on 2 nodes initialized from Slurm's variables alone"
