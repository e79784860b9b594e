#!/usr/bin/env bash
# Shared by the Slurm tests: runs COMMAND on a fresh two-node cluster
# (slurm_cluster.sh) without the rendezvous variables, prints its output,
# and fails unless it succeeded and every rank 0..3 printed "rank R <DONE>".
#   expect_ranks.sh DONE COMMAND [ARGS...]
set -u
done_text=$1
shift
here=$(cd "$(dirname "$0")" && pwd)
out=$(env -u MASTER_ADDR -u MASTER_PORT -u RANK -u WORLD_SIZE -u LOCAL_RANK \
  bash "$here/slurm_cluster.sh" "$@" 2>&1)
rc=$?
echo "$out"
[ "$rc" -eq 0 ] || { echo "slurm: '$*' failed (exit $rc)"; exit 1; }
for r in 0 1 2 3; do
  grep -q "rank $r $done_text" <<<"$out" || { echo "slurm: rank $r did not finish"; exit 1; }
done
