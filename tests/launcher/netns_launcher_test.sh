#!/usr/bin/env bash
# dtrain-run across two hosts (network namespaces joined by a veth pair):
#  1. static rendezvous, 2 nodes x 2 workers, an all_reduce job;
#  2. c10d rendezvous, the same;
#  3. c10d with --nnodes 1:2: node B's launcher is SIGKILLed mid-job; node A
#     must recover on its own (restart with the nodes left) and succeed;
#  4. static: the same kill; node A must exit cleanly (non-zero) in time;
#  5. c10d: node B's launcher is frozen (SIGSTOP) while its workers run on:
#     only its missing keep-alives tell node A, which restarts alone;
#  6. c10d scale-up: a --nnodes 2:3 job runs on A and B when node C's
#     launcher arrives (a third host, routed through A): A and B stop their
#     workers at their next monitor tick and all three meet in the next
#     round, 6 ranks, without using a restart (--max-restarts 0).
set -euo pipefail
run=$1 probe=$2
source "$(dirname "$0")/../harness/netns.sh"
netns_up 10.214.0
A=10.214.0.1
logs=$(mktemp -d)
fail() { echo "FAIL: $*"; for f in "$logs"/*; do echo "--- $f"; cat "$f"; done; exit 1; }

on() {  # on NS NAME ARGS... : start dtrain-run in NS in the background, log to NAME
  local ns=$1 name=$2; shift 2
  # exec chain (ip netns exec -> env -> dtrain-run) keeps the pid: $! is the launcher
  ip netns exec "$ns" env OMP_NUM_THREADS=1 "$run" --nproc-per-node 2 "$@" \
    >"$logs/$name" 2>&1 &
  NS_PIDS+=($!)
  eval "pid_$name=$!"
}

check_sums() {  # every rank 0..3 of job NAME(s) saw the 4-rank sum
  for r in 0 1 2 3; do
    grep -q "\[$r\]:rank $r sum 4 world 4" "$@" || fail "rank $r missing in $*"
  done
}

# 1. static
on "$NS_A" s0 --nnodes 2 --node-rank 0 --master-addr $A --master-port 29620 "$probe" allreduce
on "$NS_B" s1 --nnodes 2 --node-rank 1 --master-addr $A --master-port 29620 "$probe" allreduce
wait "$pid_s0" || fail "static node 0"
wait "$pid_s1" || fail "static node 1"
check_sums "$logs/s0" "$logs/s1"
echo "static rendezvous across 2 hosts: ok"

# 2. c10d
conf=join_timeout=30,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2
on "$NS_A" c0 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint $A:29621 --rdzv-id j2 --rdzv-conf $conf "$probe" allreduce
on "$NS_B" c1 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint $A:29621 --rdzv-id j2 --rdzv-conf $conf "$probe" allreduce
wait "$pid_c0" || fail "c10d node A"
wait "$pid_c1" || fail "c10d node B"
check_sums "$logs/c0" "$logs/c1"
echo "c10d rendezvous across 2 hosts: ok"

# 3. elastic recovery: B dies, A carries on alone
on "$NS_A" e0 --nnodes 1:2 --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint $A:29622 --rdzv-id j3 --rdzv-conf $conf "$probe" allreduce 6
on "$NS_B" e1 --nnodes 1:2 --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint $A:29622 --rdzv-id j3 --rdzv-conf $conf "$probe" allreduce 6
for i in $(seq 100); do grep -q "sum 4 world 4" "$logs/e1" 2>/dev/null && break; sleep 0.1; done
grep -q "sum 4 world 4" "$logs/e1" || fail "elastic job never started on B"
kill -9 "$pid_e1"
start=$(date +%s)
wait "$pid_e0" || fail "node A did not recover after node B was killed"
grep -q "\[0\]:rank 0 sum 2 world 2" "$logs/e0" || fail "node A did not restart as a 1-node job"
echo "elastic recovery after a node was killed: ok ($(( $(date +%s) - start )) s)"

# 4. static: A exits cleanly when B dies
on "$NS_A" k0 --nnodes 2 --node-rank 0 --master-addr $A --master-port 29623 --rdzv-conf $conf "$probe" allreduce 30
on "$NS_B" k1 --nnodes 2 --node-rank 1 --master-addr $A --master-port 29623 --rdzv-conf $conf "$probe" allreduce 30
for i in $(seq 100); do grep -q "sum 4 world 4" "$logs/k1" 2>/dev/null && break; sleep 0.1; done
kill -9 "$pid_k1"
start=$(date +%s)
if wait "$pid_k0"; then fail "node A reported success after node B was killed"; fi
took=$(( $(date +%s) - start ))
[ "$took" -le 20 ] || fail "node A took $took s to give up"
grep -q "job failed" "$logs/k0" || fail "node A printed no failure summary"
echo "static job ends cleanly after a node was killed: ok ($took s)"

# 5. keep-alive: B's launcher freezes, A notices and carries on alone
on "$NS_A" f0 --nnodes 1:2 --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint $A:29624 --rdzv-id j5 --rdzv-conf $conf "$probe" allreduce 6
on "$NS_B" f1 --nnodes 1:2 --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint $A:29624 --rdzv-id j5 --rdzv-conf $conf "$probe" allreduce 6
for i in $(seq 100); do grep -q "sum 4 world 4" "$logs/f1" 2>/dev/null && break; sleep 0.1; done
kill -STOP "$pid_f1"
start=$(date +%s)
wait "$pid_f0" || fail "node A did not recover after node B's launcher froze"
grep -q "stopped sending keep-alives" "$logs/f0" || fail "node A did not name the silent node"
grep -q "\[0\]:rank 0 sum 2 world 2" "$logs/f0" || fail "node A did not restart as a 1-node job"
kill -9 "$pid_f1"
echo "keep-alive: a frozen node was detected and left behind: ok ($(( $(date +%s) - start )) s)"

# 6. scale-up
netns_add_third 10.214.1
on "$NS_A" u0 --nnodes 2:3 --rdzv-backend c10d --rdzv-endpoint $A:29625 --rdzv-id j6 --rdzv-conf $conf "$probe" grow 60
on "$NS_B" u1 --nnodes 2:3 --rdzv-backend c10d --rdzv-endpoint $A:29625 --rdzv-id j6 --rdzv-conf $conf "$probe" grow 60
for i in $(seq 150); do grep -q "sum 4 world 4 attempt 0" "$logs/u1" 2>/dev/null && break; sleep 0.1; done
grep -q "sum 4 world 4 attempt 0" "$logs/u1" || fail "the 2-node job never started"
start=$(date +%s)
on "$NS_C" u2 --nnodes 2:3 --rdzv-backend c10d --rdzv-endpoint $A:29625 --rdzv-id j6 --rdzv-conf $conf "$probe" grow 60
for n in 0 1 2; do
  p=pid_u$n
  wait "${!p}" || fail "scale-up: node $n's launcher failed"
done
took=$(( $(date +%s) - start ))
for r in 0 1 2 3 4 5; do
  grep -q "\[$r\]:rank $r sum 6 world 6 attempt 1" "$logs/u0" "$logs/u1" "$logs/u2" || fail "scale-up: rank $r of the 3-node round missing"
done
grep -q "is running with 2 node(s) (max 3); waiting for the running nodes" "$logs/u2" || fail "node C did not say it waits"
for n in 0 1; do
  grep -q "1 node(s) waiting to join; stopped this node's workers to meet again with them in round 1 (no restart used)" "$logs/u$n" ||
    fail "node $n did not stop for the newcomer"
done
[ "$took" -le 30 ] || fail "scale-up took $took s"
echo "scale-up: a third node joined a running 2:3 job, 6 ranks in round 1, no restart used: ok ($took s)"
rm -rf "$logs"
