#!/usr/bin/env bash
# examples/kubernetes/ft-jobset.yaml as a cluster would run it, in network
# namespaces: the lighthouse "pod" on host A (the Service name
# dtrain-lighthouse resolving to it), two replica "pods" on B and C with the
# environment the manifest gives them (Kubeflow Trainer's PET_* variables,
# the master being the pod's own JobSet host name, the replica id from the
# Job's index, the job token), each name resolved through the namespace's
# hosts file as the cluster's DNS would. Replica 1's pod is killed whole
# mid-run and recreated by its Job with the same environment and host
# name: it heals from replica 0, both commit to the end, and replica 0
# misses no step.
#   netns_k8s_ft_test.sh DTRAIN_RUN TRAIN LIGHTHOUSE
set -euo pipefail
run=$1 train=$2 lighthouse=$3
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../harness/netns.sh"
source "$here/../harness/ft_commit_logs.sh"
netns_up 10.218.0
netns_add_third 10.219.0
out=$(mktemp -d)
cleanup() {
  netns_cleanup
  rm -rf "/etc/netns/$NS_A" "/etc/netns/$NS_B" "/etc/netns/$NS_C" "$out"
}
trap cleanup EXIT
fail() { echo "k8s ft: FAIL: $*"; for f in "$out"/*; do echo "--- $f"; tail -20 "$f"; done; exit 1; }
# The cluster's DNS: the Service and each pod's JobSet host name
# (<jobset>-<replicated job>-<job index>-<pod index>.<subdomain>).
for ns in "$NS_A" "$NS_B" "$NS_C"; do
  mkdir -p "/etc/netns/$ns"
  printf '127.0.0.1 localhost\n10.218.0.1 dtrain-lighthouse\n10.218.0.2 ft-replica-0-0.ft\n10.219.0.2 ft-replica-1-0.ft\n' \
    >"/etc/netns/$ns/hosts"
done
token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
ip netns exec "$NS_A" env DTRAIN_STORE_TOKEN="$token" "$lighthouse" --host 0.0.0.0 --port 29510 \
  --heartbeat-timeout 1 >"$out/lighthouse.out" 2>&1 &
NS_PIDS+=($!)
steps=600
declare -A POD
pod() {  # pod INDEX NS: the replica's container, its environment as the manifest sets it
  local k=$1 ns=$2
  ip netns exec "$ns" env -i PATH="$PATH" HOME=/root OMP_NUM_THREADS=1 \
    PET_NNODES=1 PET_NPROC_PER_NODE=2 PET_NODE_RANK=0 PET_MASTER_ADDR="ft-replica-$k-0.ft" PET_MASTER_PORT=29400 \
    JOB_INDEX="$k" DTRAIN_FT_REPLICA_ID="replica-$k" DTRAIN_FT_LIGHTHOUSE=dtrain-lighthouse:29510 \
    DTRAIN_STORE_TOKEN="$token" \
    "$run" --max-restarts 3 "$train" --steps $steps --step-ms 20 --log-every 100 \
    --commit-log "$out/replica-$k.log" >>"$out/pod-$k.out" 2>&1 &
  POD[$k]=$!
  NS_PIDS+=($!)
}
pod 0 "$NS_B"
pod 1 "$NS_C"
for _ in $(seq 600); do [ "$(ft_commits "$out/replica-1.log")" -ge 60 ] && break; sleep 0.2; done
[ "$(ft_commits "$out/replica-1.log")" -ge 60 ] || fail "replica 1 did not commit 60 steps"
# The pod fails whole (its node lost): every process of it at once.
ip netns pids "$NS_C" | xargs -r kill -9
wait "${POD[1]}" 2>/dev/null || true
echo "k8s ft: replica 1's pod killed after $(ft_commits "$out/replica-1.log") commits; its Job recreates it"
sleep 1
pod 1 "$NS_C"
wait "${POD[0]}" || fail "replica 0's pod failed"
wait "${POD[1]}" || fail "replica 1's recreated pod failed"
result=$(ft_rejoined "$out/pod-0.out" "$out/pod-1.out" "$out/replica-0.log" "$out/replica-1.log" $steps) || fail "$result"
read -r both longest <<<"$result"
echo "k8s ft: replica 1's pod recreated and healed; replica 0 never stopped (longest wait between commits" \
  "$longest ms); $both steps equal on both"
