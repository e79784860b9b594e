#!/usr/bin/env bash
# The training example end to end (2 ranks under dtrain-run, a 1200-image
# subset so it runs in seconds): a run killed at a step and resumed — by the
# user with --resume, and automatically by dtrain-run --max-restarts — ends
# with parameters bitwise identical to an uninterrupted run, also when the
# kill hits rank 0 in the middle of writing a checkpoint; resumed at 3 ranks
# instead, it continues mid-epoch and trains as well. Ranks started by
# hand (no launcher to stop the others when one fails): a checkpoint that
# rank 0 cannot save, or that one rank cannot load, stops every rank at once
# with that error.
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
grep -q "resumed from checkpoints at epoch 1, sample 640 of 1200" "$work/user2.log" || fail "did not resume at step 10 (sample 640)"
[ "$(crc user2)" = "$expected" ] || fail "user resume: crc $(crc user2) != $expected"
echo "killed at step 13, resumed with --resume: bitwise identical"

# 2. killed in the second epoch (step 23), resumed automatically by dtrain-run
job auto --max-restarts 1 -- --crash-at-step 23 || fail "auto-restart run"
grep -q "restarting the workers (restart 1 of 1)" "$work/auto.log" || fail "no restart"
grep -q "resumed from checkpoints at epoch 2, sample 64 of 1200 (restart 1)" "$work/auto.log" || fail "no automatic resume at epoch 2, step 1 (sample 64)"
[ "$(crc auto)" = "$expected" ] || fail "auto resume: crc $(crc auto) != $expected"
echo "killed at step 23, resumed by dtrain-run: bitwise identical"

# 3. rank 0 killed while writing the step-15 checkpoint: step 10's survives
job torn --max-restarts 1 -- --crash-in-checkpoint-at-step 15 || fail "torn-checkpoint run"
grep -q "resumed from checkpoints at epoch 1, sample 640 of 1200" "$work/torn.log" || fail "did not fall back to step 10"
[ "$(crc torn)" = "$expected" ] || fail "torn checkpoint: crc $(crc torn) != $expected"
echo "killed while writing a checkpoint: previous checkpoint intact, bitwise identical"

# 4. a truncated data file is refused before anything changes
data0=$(ls "$work/clean/checkpoints"/data-*-0.dtt)
truncate -s 1000 "$data0"
if (cd "$work/clean" && "$run" --standalone --nproc-per-node 2 "$train" "${common[@]}" --resume) >"$work/cut.log" 2>&1; then
  fail "a truncated checkpoint was accepted"
fi
grep -q "cannot load checkpoint checkpoints: tensor file checkpoints/data-[0-9a-f]*-0.dtt: truncated" "$work/cut.log" \
  || fail "no truncation message"
echo "truncated checkpoint: refused"

# 5. the checkpoint of 2 ranks at step 10, resumed at 3 ranks: epoch 1
# continues at sample 640 (the other 560 shared out among 3), and the job
# ends as well trained as the uninterrupted one
cp -r "$work/user" "$work/three"
(cd "$work/three" && "$run" --standalone --nproc-per-node 3 "$train" "${common[@]}" --resume) \
  >"$work/three.log" 2>&1 || fail "--resume at 3 ranks"
grep -q "resumed from checkpoints at epoch 1, sample 640 of 1200" "$work/three.log" || fail "3 ranks: not resumed at sample 640"
grep -q "written by 2 rank(s), now 3: the epoch's remaining 560 samples are shared out among 3" "$work/three.log" \
  || fail "3 ranks: no resharding message"
# the resumed epoch's progress ends at its full length as 3 ranks count it
# (13 steps of 32 per rank), not one short
grep -q "epoch 2/2 step 13/13 " "$work/three.log" || fail "3 ranks: the resumed epoch's progress does not end at 13/13"
ls "$work/three/checkpoints"/data-*-2.dtt >/dev/null || fail "3 ranks: rank 2 wrote no checkpoint file"
accuracy() { grep -o 'done: test accuracy [0-9.]*' "$work/$1.log" | awk '{print $4}'; }
awk -v a="$(accuracy three)" -v b="$(accuracy clean)" 'BEGIN { exit !(a + 0 >= b - 5) }' \
  || fail "3 ranks: accuracy $(accuracy three)% vs $(accuracy clean)% uninterrupted"
echo "2-rank checkpoint resumed at 3 ranks mid-epoch: accuracy $(accuracy three)% (uninterrupted $(accuracy clean)%)"

# by_hand NAME DIR0 DIR1 [program flags]: the 2 ranks started by hand, rank r
# in DIRr, under a long timeout (300 s); leaves NAME.r.log, NAME.r.rc and the
# seconds the job took in NAME.seconds.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' \
    2>/dev/null || echo $((20000 + RANDOM % 30000))
}
by_hand() {
  local name=$1 dirs=("$2" "$3") port start=$SECONDS pids=() r rc; shift 3
  port=$(free_port)
  for r in 0 1; do
    (cd "${dirs[$r]}" && RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      DTRAIN_TIMEOUT=300 exec timeout 400 "$train" "$@") >"$work/$name.$r.log" 2>&1 &
    pids+=($!)
  done
  for r in 0 1; do rc=0; wait "${pids[$r]}" || rc=$?; echo $rc >"$work/$name.$r.rc"; done
  echo $((SECONDS - start)) >"$work/$name.seconds"
}
# every_rank_failed NAME TEXT: both ranks exited 1 printing TEXT, in well
# under the 300 s timeout.
every_rank_failed() {
  for r in 0 1; do
    [ "$(cat "$work/$1.$r.rc")" = 1 ] || fail "$1: rank $r exited with $(cat "$work/$1.$r.rc")"
    grep -qF "dtrain-fashion-mnist: $2" "$work/$1.$r.log" || fail "$1: rank $r did not print: $2"
  done
  [ "$(cat "$work/$1.seconds")" -lt 60 ] || fail "$1: took $(cat "$work/$1.seconds") s"
}
quick=(--out-dir runs --epochs 1 --train-limit 300 --test-limit 100 --batch-size 32 --checkpoint-every 3)

# 6. no rank can save (the checkpoint directory is under a regular file)
mkdir -p "$work/nosave" && echo "a file" >"$work/nosave/blocker"
by_hand nosave "$work/nosave" "$work/nosave" "${quick[@]}" --checkpoint-dir blocker/ck
every_rank_failed nosave "cannot save checkpoint blocker/ck: rank 0: checkpoint: cannot create directory blocker/ck: Not a directory"
echo "cannot save: every rank stopped with the error in $(cat "$work/nosave.seconds") s"

# 7. rank 1 cannot load (its copy has a truncated file; rank 0's is fine): nobody resumes
mkdir -p "$work/half0" "$work/half1"
cp -r "$work/auto/checkpoints" "$work/half0/"
cp -r "$work/auto/checkpoints" "$work/half1/"
truncate -s 1000 "$(ls "$work/half1/checkpoints"/data-*-1.dtt)"
by_hand half "$work/half0" "$work/half1" "${quick[@]}" --resume
every_rank_failed half "rank 1: cannot load checkpoint checkpoints: tensor file checkpoints/data-"
if grep -q "resumed from" "$work/half.0.log"; then fail "rank 0 resumed although rank 1 could not"; fi
echo "rank 1 cannot load: every rank stopped with its error in $(cat "$work/half.seconds") s"
