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

# netns_link NS1 NS2 SUBNET TAG: a veth pair between two namespaces,
# SUBNET.1 in NS1 and SUBNET.2 in NS2, both up (with loopback).
netns_link() {
  local ns1=$1 ns2=$2 subnet=$3 tag=$4 id=$$
  local v1=dt${tag}1$id v2=dt${tag}2$id
  v1=${v1:0:15} v2=${v2:0:15}
  ip link add "$v1" type veth peer name "$v2"
  ip link set "$v1" netns "$ns1"
  ip link set "$v2" netns "$ns2"
  ip -n "$ns1" addr add "$subnet.1/24" dev "$v1"
  ip -n "$ns2" addr add "$subnet.2/24" dev "$v2"
  for ns in "$ns1" "$ns2"; do ip -n "$ns" link set lo up; done
  ip -n "$ns1" link set "$v1" up
  ip -n "$ns2" link set "$v2" up
}

netns_up() {
  local subnet=$1 id=$$
  NETNS_SUBNET=$subnet
  NS_A=dtrain-a-$id NS_B=dtrain-b-$id
  trap netns_cleanup EXIT
  ip netns add "$NS_A"
  ip netns add "$NS_B"
  netns_link "$NS_A" "$NS_B" "$subnet" v
}

netns_add_third() {
  local subnet=$1
  NS_C=dtrain-c-$$
  ip netns add "$NS_C"
  netns_link "$NS_A" "$NS_C" "$subnet" w
  # A forwards between its two links; B and C reach each other through it.
  ip netns exec "$NS_A" sysctl -qw net.ipv4.ip_forward=1
  ip -n "$NS_B" route add default via "$NETNS_SUBNET.1"
  ip -n "$NS_C" route add default via "$subnet.1"
}
