# Test hosts on one machine: network namespaces joined by a veth pair.
# Source it, then: netns_up SUBNET (e.g. 10.213.0) -> hosts $NS_A (SUBNET.1)
# and $NS_B (SUBNET.2); netns_add_third SUBNET2 adds $NS_C (SUBNET2.2) on a
# link of its own to A (SUBNET2.1), A routing between B and C. Everything is
# removed on exit (trap). Needs root; any failure to create them fails the
# test (set -e), never skips it.

NS_PIDS=()
netns_cleanup() {
  for p in "${NS_PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  [ -n "${NS_A:-}" ] && ip netns del "$NS_A" 2>/dev/null || true
  [ -n "${NS_B:-}" ] && ip netns del "$NS_B" 2>/dev/null || true
  [ -n "${NS_C:-}" ] && ip netns del "$NS_C" 2>/dev/null || true
}

netns_up() {
  local subnet=$1 id=$$
  NETNS_SUBNET=$subnet
  NS_A=dtrain-a-$id NS_B=dtrain-b-$id
  local va=dtva$id vb=dtvb$id
  va=${va:0:15} vb=${vb:0:15}
  trap netns_cleanup EXIT
  ip netns add "$NS_A"
  ip netns add "$NS_B"
  ip link add "$va" type veth peer name "$vb"
  ip link set "$va" netns "$NS_A"
  ip link set "$vb" netns "$NS_B"
  ip -n "$NS_A" addr add "$subnet.1/24" dev "$va"
  ip -n "$NS_B" addr add "$subnet.2/24" dev "$vb"
  for ns in "$NS_A" "$NS_B"; do ip -n "$ns" link set lo up; done
  ip -n "$NS_A" link set "$va" up
  ip -n "$NS_B" link set "$vb" up
}

netns_add_third() {
  local subnet=$1 id=$$
  NS_C=dtrain-c-$id
  local va=dtwa$id vc=dtwc$id
  va=${va:0:15} vc=${vc:0:15}
  ip netns add "$NS_C"
  ip link add "$va" type veth peer name "$vc"
  ip link set "$va" netns "$NS_A"
  ip link set "$vc" netns "$NS_C"
  ip -n "$NS_A" addr add "$subnet.1/24" dev "$va"
  ip -n "$NS_C" addr add "$subnet.2/24" dev "$vc"
  ip -n "$NS_C" link set lo up
  ip -n "$NS_A" link set "$va" up
  ip -n "$NS_C" link set "$vc" up
  # A forwards between its two links; B and C reach each other through it.
  ip netns exec "$NS_A" sysctl -qw net.ipv4.ip_forward=1
  ip -n "$NS_B" route add default via "$NETNS_SUBNET.1"
  ip -n "$NS_C" route add default via "$subnet.1"
}

