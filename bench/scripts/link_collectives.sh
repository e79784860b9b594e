#!/usr/bin/env bash
# dtrain-bench collectives between two "hosts": two network namespaces joined
# by a veth pair shaped to RATE (tc tbf), one rank in each (needs root).
# Usage: link_collectives.sh DTRAIN_BENCH RATE [collectives flags...]
#   e.g. link_collectives.sh build/bench/dtrain-bench 2gbit --backend tcp \
#          --min-bytes 67108864 --max-bytes 67108864
set -euo pipefail
bench=$(readlink -f "$1") rate=$2
shift 2
source "$(dirname "$0")/../../tests/harness/netns.sh"
netns_up 10.214.0
for ns in "$NS_A" "$NS_B"; do
  dev=$(ip -n "$ns" -o link show | awk -F': ' '$2 ~ /^dtv/ {print $2}' | cut -d@ -f1)
  ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$rate" burst 2mb latency 100ms
done
out=$(mktemp)
for rank in 0 1; do
  ns=$NS_A; [ "$rank" = 1 ] && ns=$NS_B
  ip netns exec "$ns" env RANK=$rank WORLD_SIZE=2 MASTER_ADDR=10.214.0.1 MASTER_PORT=29631 \
    OMP_NUM_THREADS=1 timeout 600 "$bench" collectives "$@" >"$out.$rank" 2>&1 &
done
wait
echo "link shaped to $rate between two network namespaces:"
cat "$out.0"
rm -f "$out" "$out.0" "$out.1"
