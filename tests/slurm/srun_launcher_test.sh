#!/usr/bin/env bash
# srun -N2 --ntasks-per-node=1 dtrain-run --nproc-per-node 2 under a real
# two-node Slurm (slurm_cluster.sh): each node's launcher takes --nnodes,
# --node-rank and the rendezvous endpoint from Slurm, and the 4 workers run
# every collective.
#   srun_launcher_test.sh DTRAIN_RUN RANK_WORKER
set -u
run=$1 worker=$2
here=$(cd "$(dirname "$0")" && pwd)
out=$(env -u MASTER_ADDR -u MASTER_PORT -u RANK -u WORLD_SIZE -u LOCAL_RANK \
  bash "$here/slurm_cluster.sh" srun -N2 --ntasks-per-node=1 --immediate=30 --time=2 \
  --kill-on-bad-exit=1 "$run" --nproc-per-node 2 "$worker" collectives 2>&1)
rc=$?
echo "$out"
[ "$rc" -eq 0 ] || { echo "slurm: srun of dtrain-run failed (exit $rc)"; exit 1; }
for r in 0 1 2 3; do
  grep -q "rank $r ok" <<<"$out" || { echo "slurm: rank $r did not finish"; exit 1; }
done
for n in 0 1; do
  grep -q "dtrain-run: from Slurm (one launcher per node): PET_NNODES=2 PET_NODE_RANK=$n PET_MASTER_ADDR=127.0.0.1 PET_MASTER_PORT=" <<<"$out" ||
    { echo "slurm: node $n's launcher did not take its flags from Slurm"; exit 1; }
done
echo "slurm: 2 launchers x 2 workers, every flag from Slurm"
