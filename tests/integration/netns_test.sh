#!/usr/bin/env bash
# Two "machines" on one box: two network namespaces joined by a veth pair,
# two ranks in each (world 4). Nothing is shared between them but the
# 10.213.x link, so this proves the gloo backend and the TCP store work
# across hosts, with each rank finding its own address towards MASTER_ADDR.
set -euo pipefail
worker=$1
source "$(dirname "$0")/../harness/netns.sh"
netns_up 10.213.0
logs=$(mktemp -d)

for rank in 0 1 2 3; do
  ns=$NS_A; [ "$rank" -ge 2 ] && ns=$NS_B
  ip netns exec "$ns" env RANK=$rank WORLD_SIZE=4 MASTER_ADDR=10.213.0.1 MASTER_PORT=29611 \
    DTRAIN_TIMEOUT=30 OMP_NUM_THREADS=1 timeout 90 "$worker" collectives >"$logs/$rank" 2>&1 &
  NS_PIDS+=($!)
done

status=0
for rank in 0 1 2 3; do
  if ! wait "${NS_PIDS[$rank]}"; then
    echo "rank $rank failed:"; cat "$logs/$rank"; status=1
  elif ! grep -q "rank $rank ok" "$logs/$rank"; then
    echo "rank $rank did not report ok:"; cat "$logs/$rank"; status=1
  fi
done
rm -rf "$logs"
[ $status -eq 0 ] && echo "4 ranks across 2 network namespaces: ok"
exit $status
