#!/usr/bin/env bash
# The steps of sbatch_test.sh, run inside the cluster (SLURM_CONF set).
#   sbatch_scenario.sh DTRAIN_RUN TRAIN SCRIPT WORKDIR
set -eu
run=$1 train=$2 script=$3 work=$4
cd "$work"
fail() {
  echo "sbatch: FAIL: $*"
  for f in "$work"/*.out "$work"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -25 "$f"; }; done
  squeue 2>&1 | head
  exit 1
}
# waits up to $1 s for the command after it to succeed
wait_for() {
  local limit=$1; shift
  for _ in $(seq $((limit * 5))); do "$@" && return 0; sleep 0.2; done
  return 1
}
job_gone() { [ -z "$(squeue -h -j "$1" 2>/dev/null)" ]; }
accuracy() { grep -o 'done: test accuracy [0-9.]*' "$1" | awk '{print $4}'; }

args=(--epochs 2 --train-limit 16000 --test-limit 2000 --checkpoint-every 5 --seed 1)
export DTRAIN_RUN=$run TRAIN=$train CHECKPOINT_DIR=$work/checkpoints

# The same job run locally, 4 ranks under one launcher.
"$run" --standalone --nproc-per-node 4 "$train" "${args[@]}" --checkpoint-dir "$work/local-ckpt" \
  --out-dir runs/local >local.log 2>&1 || fail "the local run failed"
local_accuracy=$(accuracy local.log)
[ -n "$local_accuracy" ] || fail "no accuracy from the local run"

# 1. submitted, then cancelled once it has written a checkpoint
first=$(sbatch --parsable "$script" "${args[@]}" | cut -d';' -f1) || fail "sbatch refused the script"
wait_for 120 test -f "$CHECKPOINT_DIR/metadata.dtt" || fail "job $first wrote no checkpoint"
job_gone "$first" && fail "job $first ended before it could be cancelled"
scancel "$first"
wait_for 90 job_gone "$first" || fail "job $first still listed 90 s after scancel"
# This job's launchers and workers, and only theirs (other tests may run
# the same programs at the same time): their arguments name its checkpoint.
mine="--checkpoint-dir $CHECKPOINT_DIR"
none_left() { ! pgrep -f -- "$mine" >/dev/null; }
wait_for 10 none_left || fail "processes left after scancel: $(pgrep -af -- "$mine")"
grep -q "dtrain-run: received SIGTERM" "dtrain-fashion-mnist-$first.out" || fail "the launchers did not see scancel's SIGTERM"
grep -q "done: test accuracy" "dtrain-fashion-mnist-$first.out" && fail "job $first finished before scancel"
echo "sbatch: job $first cancelled after its first checkpoint; no process left"

# 2. the same script submitted again resumes from that checkpoint
second=$(sbatch --parsable "$script" "${args[@]}" | cut -d';' -f1) || fail "sbatch refused the script"
wait_for 240 job_gone "$second" || fail "job $second did not finish"
out="dtrain-fashion-mnist-$second.out"
grep -q "train.sbatch: resuming from $CHECKPOINT_DIR" "$out" || fail "the script did not see the checkpoint"
grep -q "resumed from $CHECKPOINT_DIR at epoch" "$out" || fail "job $second did not resume"
grep -q "dtrain-run: from Slurm (one launcher per node): PET_NNODES=2" "$out" || fail "the launchers did not take their flags from Slurm"
cluster_accuracy=$(accuracy "$out")
[ -n "$cluster_accuracy" ] || fail "job $second did not finish training"
awk -v a="$cluster_accuracy" -v b="$local_accuracy" 'BEGIN { d = a - b; exit !(d <= 1.5 && d >= -1.5) }' ||
  fail "accuracy $cluster_accuracy% on the cluster vs $local_accuracy% locally"
echo "sbatch: job $second resumed ($(grep -o 'resumed from [^(]*' "$out")) and reached $cluster_accuracy% (local 4-rank run: $local_accuracy%)"
