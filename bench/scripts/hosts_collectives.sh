#!/usr/bin/env bash
# dtrain-bench collectives between two "hosts" with several ranks on each:
# two network namespaces joined by a veth pair (shaped to RATE with tc tbf,
# or left as it is with RATE "none"), PER_HOST ranks in each (needs root).
# Each BENCH binary (this build's, and others built beside it, such as an
# older commit's) runs in turn, RUNS times, in the same namespaces; after
# each run the bytes that crossed the veth and the run's wall time are
# printed, so the link's use can be read off.
# With MPI_PROGRAM set (build/bench/mpi-allreduce-baseline), each run also
# times OpenMPI's MPI_Allreduce on the same hosts and ranks, at MPI_SIZES
# (bytes; default 4 and 16 MiB): mpirun in the first namespace starts the
# second's ranks through an rsh agent that enters that namespace; shared
# memory inside a host, TCP over the veth between them (mpirun's default
# BTLs, as dtrain's auto), or TCP only with MPI_BTL=tcp,self.
# Usage: hosts_collectives.sh RATE PER_HOST RUNS "BENCH..." [collectives flags...]
#   e.g. hosts_collectives.sh 2gbit 2 3 "build/bench/dtrain-bench /tmp/old/build/bench/dtrain-bench" \
#          --backend auto --op all_reduce --min-bytes 16777216 --max-bytes 16777216
set -euo pipefail
rate=$1 per_host=$2 runs=$3 benches=$4
shift 4
source "$(dirname "$0")/../../tests/harness/netns.sh"
netns_up 10.215.0
dev_a=$(ip -n "$NS_A" -o link show | awk -F': ' '$2 ~ /^dtv/ {print $2}' | cut -d@ -f1)
if [ "$rate" != none ]; then
  for ns in "$NS_A" "$NS_B"; do
    dev=$(ip -n "$ns" -o link show | awk -F': ' '$2 ~ /^dtv/ {print $2}' | cut -d@ -f1)
    ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$rate" burst 2mb latency 100ms
  done
fi
world=$((2 * per_host))
out=$(mktemp -d)
trap 'rm -rf "$out"; netns_cleanup' EXIT
run_mpi() {
  local agent=$out/rsh-agent
  # OpenMPI's rsh launcher calls AGENT HOST COMMAND...: run it in HOST's namespace.
  # Both namespaces share the machine's hostname and /dev/shm: the second
  # host's ranks get a hostname of their own (a UTS namespace), so that
  # OpenMPI does not take them for the first host's, and their
  # shared-memory segments a folder of their own.
  mkdir -p "$out/shm-a" "$out/shm-b"
  printf '#!/bin/sh\nhost=$1; shift\nexec ip netns exec %s unshare --uts env OMPI_MCA_btl_vader_backing_directory=%s sh -c "hostname dtrain-host-b; $*"\n' \
    "$NS_B" "$out/shm-b" >"$agent"
  chmod +x "$agent"
  echo "== run $run: OpenMPI MPI_Allreduce ($world ranks, $per_host per host, link $rate, btl ${MPI_BTL:-default})"
  ip netns exec "$NS_A" env OMPI_MCA_btl_vader_backing_directory="$out/shm-a" timeout 600 mpirun --allow-run-as-root --oversubscribe -np "$world" \
    --host "10.215.0.1:$per_host,10.215.0.2:$per_host" --mca plm_rsh_agent "$agent" \
    --mca oob_tcp_if_include 10.215.0.0/24 --mca btl_tcp_if_include 10.215.0.0/24 \
    ${MPI_BTL:+--mca btl "$MPI_BTL" --mca pml ob1} "$MPI_PROGRAM" ${MPI_SIZES:-4194304 16777216}
}
port=29641
for run in $(seq 1 "$runs"); do
  for bench in $benches; do
    port=$((port + 1))
    tx0=$(ip netns exec "$NS_A" cat /sys/class/net/"$dev_a"/statistics/tx_bytes)
    rx0=$(ip netns exec "$NS_A" cat /sys/class/net/"$dev_a"/statistics/rx_bytes)
    start=$(date +%s.%N)
    for rank in $(seq 0 $((world - 1))); do
      ns=$NS_A; [ "$rank" -ge "$per_host" ] && ns=$NS_B
      ip netns exec "$ns" env RANK=$rank WORLD_SIZE=$world LOCAL_RANK=$((rank % per_host)) \
        MASTER_ADDR=10.215.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 \
        timeout 600 "$bench" collectives "$@" >"$out/$rank" 2>&1 &
    done
    wait
    end=$(date +%s.%N)
    tx1=$(ip netns exec "$NS_A" cat /sys/class/net/"$dev_a"/statistics/tx_bytes)
    rx1=$(ip netns exec "$NS_A" cat /sys/class/net/"$dev_a"/statistics/rx_bytes)
    echo "== run $run: $bench ($world ranks, $per_host per host, link $rate)"
    grep -v '^#' "$out/0" | grep -E '^ *[0-9]' || cat "$out/0"
    awk -v a="$tx1" -v b="$tx0" -v c="$rx1" -v d="$rx0" -v s="$start" -v e="$end" 'BEGIN {
      printf "link: %.1f MB out, %.1f MB in over %.2f s of run\n", (a-b)/1e6, (c-d)/1e6, e-s }'
  done
  if [ -n "${MPI_PROGRAM:-}" ]; then run_mpi; fi
done
