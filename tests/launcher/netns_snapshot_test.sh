#!/usr/bin/env bash
# Snapshots in a peer's memory, across two hosts (network namespaces):
# 2 hosts x 2 ranks train (snapshot_worker: FSDP, Adam) with a snapshot
# every 5 steps and a checkpoint on disk every 50. Host B is lost whole
# (its dtrain-run and every worker SIGKILLed) in the 30s; its dtrain-run is
# started again, host A's restarts its own workers. The job must resume
# from the snapshot host A's keeper holds (losing at most 5 steps, where
# the disk would lose 30 and more) and from there train bitwise as a run
# that was never interrupted.
set -euo pipefail
run=$1 worker=$2
source "$(dirname "$0")/../harness/netns.sh"
netns_up 10.215.0
A=10.215.0.1
logs=$(mktemp -d)
steps=60 every=5 disk_every=50 sleep_ms=150
fail() { echo "FAIL: $*"; for f in "$logs"/*.log; do echo "--- $f"; cat "$f"; done; exit 1; }
conf=join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3

on() {  # on NS NAME ARGS...: dtrain-run in NS, in the background, log NAME.log
  local ns=$1 name=$2; shift 2
  ip netns exec "$ns" env OMP_NUM_THREADS=1 "$run" "$@" >"$logs/$name.log" 2>&1 &
  NS_PIDS+=($!)
  eval "pid_$name=$!"
}
states() {  # "step rank crc" lines of the given logs, after step S (arg 1), of attempts >= A (arg 2)
  local after=$1 attempt=$2; shift 2
  sed -n 's/^\[[0-9]*\]:step \([0-9]*\) rank \([0-9]*\) attempt \([0-9]*\) state \([0-9a-f]*\) loss .*$/\1 \2 \3 \4/p' "$@" |
    awk -v s="$after" -v a="$attempt" '$1 > s && $3 >= a { print $1, $2, $4 }' | sort -n -k1,1 -k2,2 -u
}

# The uninterrupted run: host A alone, 4 workers (the tcp backend's sums
# depend only on the ranks' numbers).
on "$NS_A" ref --standalone --nproc-per-node 4 "$worker" $steps $every $disk_every "$logs/ref-ckpt" 0
wait "$pid_ref" || fail "the uninterrupted run failed"
[ "$(states -1 0 "$logs/ref.log" | wc -l)" -eq $((steps * 4)) ] || fail "the uninterrupted run printed too few steps"

job=(--nnodes 2 --nproc-per-node 2 --max-restarts 2 --rdzv-backend c10d --rdzv-endpoint $A:29630
     --rdzv-id snap --rdzv-conf $conf "$worker" $steps $every $disk_every "$logs/ckpt" $sleep_ms)
on "$NS_A" a "${job[@]}"
on "$NS_B" b "${job[@]}"
for i in $(seq 600); do
  last=$(states -1 0 "$logs/a.log" "$logs/b.log" | awk 'END { print $1 + 0 }')
  [ "$last" -ge 33 ] && break
  sleep 0.05
done
[ "$last" -ge 33 ] || fail "the job never reached step 33"
# Host B is lost: every process in its namespace, launcher and workers.
ip netns pids "$NS_B" | xargs -r kill -9
lost=$(states -1 0 "$logs/a.log" "$logs/b.log" | awk 'END { print $1 + 0 }')
echo "host B killed after step $lost"
on "$NS_B" b2 "${job[@]}"
wait "$pid_a" || fail "host A's launcher failed"
wait "$pid_b2" || fail "host B's new launcher failed"
resumed=$(sed -n 's/^\[0\]:resumed from snapshot \([0-9]*\)$/\1/p' "$logs/a.log" "$logs/b2.log" | tail -1)
[ -n "$resumed" ] || fail "the restarted job did not resume from a snapshot"
[ $((lost - resumed)) -le $every ] || fail "resumed at step $resumed, $((lost - resumed)) steps before step $lost (more than $every)"
[ "$resumed" -gt 0 ] || fail "the snapshot is not newer than the disk's step 0"
diff <(states "$resumed" 1 "$logs/a.log" "$logs/b2.log") <(states "$resumed" 0 "$logs/ref.log") >"$logs/diff" ||
  fail "steps after $resumed differ from the uninterrupted run: $(head -5 "$logs/diff")"
[ "$(states "$resumed" 1 "$logs/a.log" "$logs/b2.log" | wc -l)" -eq $(( (steps - resumed - 1) * 4 )) ] ||
  fail "steps after $resumed are missing"
echo "host B lost after step $lost: resumed from the snapshot of step $resumed on host A (disk: step 0), steps $((resumed + 1))..$((steps - 1)) bitwise the uninterrupted run's: ok"
rm -rf "$logs"
