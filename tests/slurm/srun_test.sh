#!/usr/bin/env bash
# srun -N2 -n4 of rank_worker's collectives under a real two-node Slurm
# (slurm_cluster.sh), with no MASTER_ADDR, MASTER_PORT, RANK or WORLD_SIZE:
# rank and world come from SLURM_PROCID/SLURM_NTASKS, the rendezvous host
# from SLURM_STEP_NODELIST's first node (n1, which is not in DNS: its
# NodeAddr from scontrol), the port from the job and step ids.
#   srun_test.sh RANK_WORKER
set -u
worker=$1
here=$(cd "$(dirname "$0")" && pwd)
out=$(env -u MASTER_ADDR -u MASTER_PORT -u RANK -u WORLD_SIZE -u LOCAL_RANK \
  bash "$here/slurm_cluster.sh" srun -N2 -n4 --immediate=30 --time=2 --kill-on-bad-exit=1 \
  "$worker" collectives 2>&1)
rc=$?
echo "$out"
[ "$rc" -eq 0 ] || { echo "slurm: srun failed (exit $rc)"; exit 1; }
for r in 0 1 2 3; do
  grep -q "rank $r ok" <<<"$out" || { echo "slurm: rank $r did not finish"; exit 1; }
done
echo "slurm: 4 ranks on 2 nodes initialized from Slurm's variables alone"
