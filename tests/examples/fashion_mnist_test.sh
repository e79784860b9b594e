#!/usr/bin/env bash
# The training example end to end (2 ranks under dtrain-run, a 1200-image
# subset so it runs in seconds): a run killed at a step and resumed — by the
# user with --resume, and automatically by dtrain-run --max-restarts — ends
# with parameters bitwise identical to an uninterrupted run, also when the
# kill hits rank 0 in the middle of writing a checkpoint.
set -euo pipefail
run=$1 train=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; for f in "$work"/*.log; do echo "--- $f"; tail -20 "$f"; done; exit 1; }
common=(--out-dir runs --epochs 2 --train-limit 1200 --test-limit 500 --batch-size 32 --checkpoint-every 5 --seed 3)

job() {  # job NAME [dtrain-run flags] -- [program flags]
  local name=$1; shift
  local launcher=()
  while [ "$1" != "--" ]; do launcher+=("$1"); shift; done; shift
  mkdir -p "$work/$name"
  (cd "$work/$name" && "$run" --standalone --nproc-per-node 2 "${launcher[@]}" "$train" "${common[@]}" "$@") \
    >"$work/$name.log" 2>&1
}
crc() { grep -o 'parameters crc32 [0-9a-f]*' "$work/$1.log" | awk '{print $3}'; }

job clean -- || fail "uninterrupted run"
expected=$(crc clean)
[ -n "$expected" ] || fail "no checksum from the uninterrupted run"
grep -q "epoch 2/2: train loss" "$work/clean.log" || fail "no epoch line"
test -s "$work/clean/runs/metrics.jsonl" || fail "no metrics file"
test -s "$work/clean/runs/training.png" || fail "no plot"
echo "uninterrupted: crc $expected"

# 19 steps per epoch; checkpoints every 5 steps and at each epoch's end.
# An --out-dir with shell and gnuplot metacharacters is only a name: the plot
# lands in it and nothing in it runs.
odd="$work/odd/it's \$(touch $work/INJECTED); \`touch $work/INJECTED\`"
mkdir -p "$work/odd"
(cd "$work/odd" && "$run" --standalone --nproc-per-node 2 "$train" --out-dir "$odd" --epochs 1 \
  --train-limit 300 --test-limit 100 --batch-size 32 --checkpoint-every 0) >"$work/odd.log" 2>&1 \
  || fail "run with an odd --out-dir"
test ! -e "$work/INJECTED" || fail "--out-dir was run by a shell"
test -s "$odd/training.png" || fail "no plot in the odd --out-dir"
echo "odd --out-dir: plot written, nothing executed"

# 1. killed at step 13 (rank 1, SIGKILL), then resumed by the user
if job user -- --crash-at-step 13; then fail "the crashing run succeeded"; fi
grep -q "killed by SIGKILL" "$work/user.log" || fail "no SIGKILL in the summary"
cp -r "$work/user" "$work/user2"
(cd "$work/user2" && "$run" --standalone --nproc-per-node 2 "$train" "${common[@]}" --resume) \
  >"$work/user2.log" 2>&1 || fail "--resume run"
grep -q "resumed from checkpoints/checkpoint.pt at epoch 1, step 10" "$work/user2.log" || fail "did not resume at step 10"
[ "$(crc user2)" = "$expected" ] || fail "user resume: crc $(crc user2) != $expected"
echo "killed at step 13, resumed with --resume: bitwise identical"

# 2. killed in the second epoch (step 23), resumed automatically by dtrain-run
job auto --max-restarts 1 -- --crash-at-step 23 || fail "auto-restart run"
grep -q "restarting the workers (restart 1 of 1)" "$work/auto.log" || fail "no restart"
grep -q "resumed from checkpoints/checkpoint.pt at epoch 2, step 1 (restart 1)" "$work/auto.log" || fail "no automatic resume at epoch 2, step 1"
[ "$(crc auto)" = "$expected" ] || fail "auto resume: crc $(crc auto) != $expected"
echo "killed at step 23, resumed by dtrain-run: bitwise identical"

# 3. rank 0 killed while writing the step-15 checkpoint: step 10's survives
job torn --max-restarts 1 -- --crash-in-checkpoint-at-step 15 || fail "torn-checkpoint run"
grep -q "resumed from checkpoints/checkpoint.pt at epoch 1, step 10" "$work/torn.log" || fail "did not fall back to step 10"
[ "$(crc torn)" = "$expected" ] || fail "torn checkpoint: crc $(crc torn) != $expected"
echo "killed while writing a checkpoint: previous checkpoint intact, bitwise identical"

# 4. a truncated checkpoint is refused before anything changes
head -c 1000 "$work/clean/checkpoints/checkpoint.pt" >"$work/clean/checkpoints/cut.pt"
mv "$work/clean/checkpoints/cut.pt" "$work/clean/checkpoints/checkpoint.pt"
if (cd "$work/clean" && "$run" --standalone --nproc-per-node 2 "$train" "${common[@]}" --resume) >"$work/cut.log" 2>&1; then
  fail "a truncated checkpoint was accepted"
fi
grep -q "checkpoint checkpoints/checkpoint.pt is truncated or corrupt" "$work/cut.log" || fail "no truncation message"
echo "truncated checkpoint: refused"
