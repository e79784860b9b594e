#!/usr/bin/env bash
# Two "machines" on one box: two network namespaces joined by a veth pair,
# two ranks in each (world 4). Nothing is shared between them but the
# 10.213.x link (and /dev/shm, which dtrain must not use across them), so
# this proves that the TCP store, the tcp backend (and its "gloo" alias) and
# the "auto" backend (shared-memory rings within each namespace, tcp between) work across
# hosts, that ranks meeting through file:// or a store the user built find
# addresses their peers can reach (no master host names the network there),
# and that a forced "shm" refuses ranks on different machines.
set -euo pipefail
worker=$1
source "$(dirname "$0")/../harness/netns.sh"
netns_up 10.213.0
logs=$(mktemp -d)
trap 'rm -rf "$logs"; netns_cleanup' EXIT

# run_job BACKEND PORT [INIT_METHOD]: starts the 4 ranks; leaves their exit
# codes in $logs/rc.R.
run_job() {
  local backend=$1 port=$2 init=${3:-env://} pids=()
  for rank in 0 1 2 3; do
    ns=$NS_A; [ "$rank" -ge 2 ] && ns=$NS_B
    ip netns exec "$ns" env RANK=$rank WORLD_SIZE=4 MASTER_ADDR=10.213.0.1 MASTER_PORT=$port \
      DTRAIN_TIMEOUT=30 OMP_NUM_THREADS=1 timeout 90 "$worker" collectives "$init" "$backend" \
      >"$logs/$rank" 2>&1 &
    pids+=($!)
  done
  for rank in 0 1 2 3; do
    rc=0; wait "${pids[$rank]}" || rc=$?
    echo $rc >"$logs/rc.$rank"
  done
}

status=0
fail() { echo "FAIL: $1"; cat "$logs/$2"; status=1; }

# BACKEND|INIT_METHOD|the backend name each rank must report
for spec in "auto|env://|auto (shm within 2 machines, tcp between)" "tcp|env://|tcp" \
            "gloo|env://|tcp" "tcp|user-store|tcp" "tcp|file://$logs/filestore|tcp" \
            "auto|user-store|auto (shm within 2 machines, tcp between)"; do
  IFS='|' read -r backend init expected <<<"$spec"
  rm -f "$logs/filestore"
  run_job "$backend" 29611 "$init"
  for rank in 0 1 2 3; do
    [ "$(cat "$logs/rc.$rank")" = 0 ] || { fail "$backend: rank $rank exited $(cat "$logs/rc.$rank")" $rank; continue; }
    grep -qF "rank $rank backend $expected" "$logs/$rank" || fail "$backend: rank $rank did not use '$expected'" $rank
    grep -q "rank $rank ok" "$logs/$rank" || fail "$backend: rank $rank did not report ok" $rank
  done
  [ $status -eq 0 ] && echo "$backend over ${init%%/*}: 4 ranks across 2 network namespaces: ok"
done

run_job shm 29612
for rank in 0 1 2 3; do
  grep -q "caught BackendUnavailable: .*the ranks are on 2 different machines (ranks 0,1 | ranks 2,3); shm needs one machine" "$logs/$rank" \
    || fail "shm across namespaces: rank $rank did not refuse clearly" $rank
done
[ $status -eq 0 ] && echo "shm across 2 network namespaces: refused on every rank: ok"
exit $status
