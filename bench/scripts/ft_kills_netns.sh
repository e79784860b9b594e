#!/usr/bin/env bash
# Fault tolerance against restarting the whole job, under the same kills,
# on three "hosts": network namespaces A, B and C (B and C linked to A, A
# routing between them), each link shaped to RATE (tc tbf) unless "none".
# One replica of 2 ranks per host, FSDP inside (FT-HSDP), the
# Fashion-MNIST example. For DURATION seconds from the first commit, every
# KILL_EVERY seconds every process of the replica on B, then C, then B...
# is SIGKILLed (its dtrain-run and its workers), and that host's dtrain-run
# is started again RESTART_AFTER seconds later. Two runs, one after the
# other (needs root):
#  1. dtrain::ft: dtrain-lighthouse on A, one dtrain-run per host, each its
#     own replica (--max-restarts 100, a heartbeat timeout of HEARTBEAT s).
#  2. Without it: one job of 3 nodes x 2 ranks (HSDP over them), each host's
#     dtrain-run --max-restarts 100 in one c10d rendezvous on A, a snapshot
#     in peers' memory every 10 steps, resumed from after each restart.
# Prints the samples committed in the window by each and their ratio; for
# dtrain::ft also the longest wait between two commits of A's replica
# (never killed), how long each restarted replica took from its launch to
# its first commit, and checks that every replica that committed a step
# holds the same state and that the committed blocks of samples follow
# each other with no gap and no overlap.
# Usage: ft_kills_netns.sh RUN EXAMPLE LIGHTHOUSE [RATE] [DURATION] [KILL_EVERY] [RESTART_AFTER] [HEARTBEAT]
#   e.g. ft_kills_netns.sh build/tools/dtrain-run/dtrain-run build/examples/dtrain-ft-fashion-mnist \
#          build/tools/dtrain-lighthouse/dtrain-lighthouse 1gbit 300 30 10 2
set -euo pipefail
run=$(realpath "$1") example=$(realpath "$2") lighthouse=$(realpath "$3")
rate=${4:-1gbit} duration=${5:-300} kill_every=${6:-30} restart_after=${7:-10} heartbeat=${8:-2}
source "$(dirname "$0")/../../tests/harness/netns.sh"
netns_up 10.216.0
netns_add_third 10.217.0
A=10.216.0.1
declare -A NS=([a]=$NS_A [b]=$NS_B [c]=$NS_C)
if [ "$rate" != none ]; then
  for ns in "$NS_A" "$NS_B" "$NS_C"; do
    for dev in $(ip -n "$ns" -o link show | awk -F': ' '$2 ~ /^dt/ {print $2}' | cut -d@ -f1); do
      ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$rate" burst 2mb latency 100ms
    done
  done
fi
out=$(mktemp -d /tmp/ft-kills.XXXXXX)
trap 'netns_cleanup; echo "logs: $out"' EXIT
export DTRAIN_STORE_TOKEN=ft-kills-bench OMP_NUM_THREADS=1
conf=join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3
now_ms() { date +%s%3N; }

declare -A PID
start_host() {  # start_host MODE HOST: that host's dtrain-run, in the background
  local mode=$1 h=$2 k
  k=$(printf '%d' "'$h"); k=$((k - 97))
  if [ "$mode" = ft ]; then
    ip netns exec "${NS[$h]}" "$run" --standalone --nproc-per-node 2 --max-restarts 100 "$example" \
      --replica-index $k --lighthouse $A:29510 --steps 100000000 --fsdp --log-every 1000000 \
      --commit-log "$out/ft-$h.log" >>"$out/ft-$h.out" 2>&1 &
  else
    ip netns exec "${NS[$h]}" "$run" --nnodes 3 --nproc-per-node 2 --max-restarts 100 --rdzv-backend c10d \
      --rdzv-endpoint $A:29630 --rdzv-id ft-kills --rdzv-conf $conf "$example" --steps 100000000 --fsdp \
      --log-every 1000000 --baseline-snapshot-every 10 --commit-log "$out/base.log" >>"$out/base-$h.out" 2>&1 &
  fi
  PID[$h]=$!
  NS_PIDS+=($!)
}
kill_host() {  # kill_host HOST: its dtrain-run and every worker of it, at once
  local pid=${PID[$1]}
  local workers
  workers=$(pgrep -P "$pid" || true)
  kill -9 "$pid" $workers 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
first_commit_ms() {  # the first commit's unix ms in the logs PATTERN names (waits for one)
  local pattern=$1 t
  for _ in $(seq 1200); do
    # shellcheck disable=SC2086 # the pattern is expanded now, once the logs exist
    t=$(awk 'NF >= 7 && length($2) == 16 { print $3; exit }' $pattern 2>/dev/null || true)
    [ -n "$t" ] && { echo "$t"; return; }
    sleep 0.1
  done
  echo "no commit within 120 s" >&2
  exit 1
}

run_mode() {  # run_mode MODE: start, kill on schedule, stop; restarts in $out/MODE-restarts
  local mode=$1 t0 end victim=b next
  : >"$out/$mode-restarts"
  if [ "$mode" = ft ]; then
    ip netns exec "$NS_A" "$lighthouse" --host $A --port 29510 --heartbeat-timeout "$heartbeat" \
      >"$out/lighthouse.out" 2>&1 &
    NS_PIDS+=($!)
    sleep 1
  fi
  for h in a b c; do start_host "$mode" $h; done
  if [ "$mode" = ft ]; then t0=$(first_commit_ms "$out/ft-*.log"); else t0=$(first_commit_ms "$out/base.log"); fi
  echo "$mode: first commit at $t0; $duration s of kills every $kill_every s"
  end=$((t0 + duration * 1000))
  next=$((t0 + kill_every * 1000))
  while [ "$next" -lt "$end" ]; do
    sleep "$(awk -v d=$((next - $(now_ms))) 'BEGIN { print (d > 0 ? d / 1000 : 0) }')"
    kill_host $victim
    echo "$mode: killed host $victim at +$(( ($(now_ms) - t0) / 1000 )) s"
    sleep "$restart_after"
    start_host "$mode" $victim
    echo "$victim $(now_ms)" >>"$out/$mode-restarts"
    victim=$([ $victim = b ] && echo c || echo b)
    next=$((next + kill_every * 1000))
  done
  sleep "$(awk -v d=$((end - $(now_ms))) 'BEGIN { print (d > 0 ? d / 1000 : 0) }')"
  for h in a b c; do kill_host $h; done
  pkill -9 -f "$lighthouse" 2>/dev/null || true
  echo "$t0 $end" >"$out/$mode-window"
}

# Progress at the window's end: in each log the last commit written by
# then (a job restarted from a snapshot redoes steps: its last line is
# where it stands), its first sample + samples; the most of the logs.
samples_by() {  # samples_by END LOGS...
  local end=$1 best=0 f n; shift
  for f in "$@"; do
    n=$(awk -v e="$end" 'NF >= 7 && length($2) == 16 && $3 <= e { last = $4 + $5 } END { print last + 0 }' "$f")
    [ "$n" -gt "$best" ] && best=$n
  done
  echo "$best"
}

run_mode ft
read -r t0 end <"$out/ft-window"
ft=$(samples_by "$end" "$out"/ft-*.log)
# Survivors' stalls: A's replica was never killed.
stall=$(awk -v e="$end" 'NF >= 7 && $3 <= e { if (p && $3 - p > m) m = $3 - p; p = $3 } END { print m + 0 }' "$out/ft-a.log")
# Equal states and one history: every step's hash and block the same in
# every log that committed it in one quorum ($6); the blocks contiguous
# from the first.
check=$(cat "$out"/ft-*.log | awk 'NF >= 7 && length($2) == 16 {
    k = $1 " " $6
    if (k in h) { if (h[k] != $2 || f[$1] != $4 || c[$1] != $5) bad++ } else { h[k] = $2; if (!($1 in f)) n++; f[$1] = $4; c[$1] = $5 }
  } END {
    gaps = 0; expect = -1
    for (s = 1; s <= n; s++) { if (!(s in f)) { gaps++; continue } if (expect >= 0 && f[s] != expect) gaps++; expect = f[s] + c[s] }
    print n " steps, " (bad + 0) " differing, " gaps " gaps or overlaps" }')
echo "ft: $ft samples committed in $duration s; A's longest wait between commits $stall ms; $check"
while read -r h t; do
  first=$(awk -v t="$t" 'NF >= 7 && $3 >= t { print $3 - t; exit }' "$out/ft-$h.log")
  echo "ft: host $h relaunched at +$(( (t - t0) / 1000 )) s: first commit ${first:-never} ms after its launch"
done <"$out/ft-restarts"

run_mode base
read -r t0 end <"$out/base-window"
base=$(samples_by "$end" "$out/base.log")
echo "restarting the job: $base samples committed in $duration s"
awk -v f="$ft" -v b="$base" 'BEGIN { printf "dtrain::ft / restarting the job: %.2fx the samples\n", (b > 0 ? f / b : 0) }'
