#!/usr/bin/env bash
# srun -N2 --ntasks-per-node=1 dtrain-run --nproc-per-node 2 under a real
# two-node Slurm: each node's launcher takes --nnodes, --node-rank and the
# rendezvous endpoint from Slurm, and the 4 workers run every collective.
#   srun_launcher_test.sh DTRAIN_RUN RANK_WORKER
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=$(bash "$here/expect_ranks.sh" ok srun -N2 --ntasks-per-node=1 --immediate=30 --time=2 \
  --kill-on-bad-exit=1 "$1" --nproc-per-node 2 "$2" collectives) || { echo "$out"; exit 1; }
echo "$out"
for n in 0 1; do
  grep -q "dtrain-run: from Slurm (one launcher per node): PET_NNODES=2 PET_NODE_RANK=$n PET_MASTER_ADDR=127.0.0.1 PET_MASTER_PORT=" <<<"$out" ||
    { echo "slurm: node $n's launcher did not take its flags from Slurm"; exit 1; }
done
echo "slurm: 2 launchers x 2 workers, every flag from Slurm"
