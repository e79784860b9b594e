#!/usr/bin/env bash
# examples/slurm/train.sbatch under a real two-node Slurm (slurm_cluster.sh):
# submitted with sbatch, it trains Fashion-MNIST on 2 nodes x 2 ranks with no
# rendezvous variables set; scancel stops every rank (no process left) with
# its checkpoint intact; the script submitted again resumes from it and ends
# as accurate as the same job run locally on 4 ranks.
#   sbatch_test.sh DTRAIN_RUN TRAIN SCRIPT
set -eu
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d /tmp/dtrain-sbatch-XXXXXX)
chmod 755 "$work"
trap 'rm -rf "$work"' EXIT
env -u MASTER_ADDR -u MASTER_PORT -u RANK -u WORLD_SIZE -u LOCAL_RANK \
  bash "$here/slurm_cluster.sh" bash "$here/sbatch_scenario.sh" "$1" "$2" "$3" "$work"
