#!/usr/bin/env bash
# Two "machines" on one box: two network namespaces joined by a veth pair,
# two ranks in each (world 4). Nothing is shared between them but the
# 10.213.x link, so this proves the gloo backend and the TCP store work
# across hosts, with each rank finding its own address towards MASTER_ADDR.
# Needs root (ip netns); fails, never skips, when it cannot set them up.
set -euo pipefail
worker=$1
id=$$
ns0=dtrain-a-$id ns1=dtrain-b-$id v0=dtva$id v1=dtvb$id
logs=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  ip netns del "$ns0" 2>/dev/null || true
  ip netns del "$ns1" 2>/dev/null || true
  rm -rf "$logs"
}
trap cleanup EXIT

ip netns add "$ns0"
ip netns add "$ns1"
ip link add "${v0:0:15}" type veth peer name "${v1:0:15}"
ip link set "${v0:0:15}" netns "$ns0"
ip link set "${v1:0:15}" netns "$ns1"
ip -n "$ns0" addr add 10.213.0.1/24 dev "${v0:0:15}"
ip -n "$ns1" addr add 10.213.0.2/24 dev "${v1:0:15}"
for ns in "$ns0" "$ns1"; do
  ip -n "$ns" link set lo up
done
ip -n "$ns0" link set "${v0:0:15}" up
ip -n "$ns1" link set "${v1:0:15}" up

for rank in 0 1 2 3; do
  ns=$ns0; [ "$rank" -ge 2 ] && ns=$ns1
  ip netns exec "$ns" env RANK=$rank WORLD_SIZE=4 MASTER_ADDR=10.213.0.1 MASTER_PORT=29611 \
    DTRAIN_TIMEOUT=30 OMP_NUM_THREADS=1 timeout 90 "$worker" collectives >"$logs/$rank" 2>&1 &
  pids+=($!)
done

status=0
for rank in 0 1 2 3; do
  if ! wait "${pids[$rank]}"; then
    echo "rank $rank failed:"; cat "$logs/$rank"; status=1
  elif ! grep -q "rank $rank ok" "$logs/$rank"; then
    echo "rank $rank did not report ok:"; cat "$logs/$rank"; status=1
  fi
done
pids=()
[ $status -eq 0 ] && echo "4 ranks across 2 network namespaces: ok"
exit $status
