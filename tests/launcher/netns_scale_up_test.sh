#!/usr/bin/env bash
# Elastic scale-up of the Fashion-MNIST job across hosts (network
# namespaces; the checkpoint directory is shared, as on a cluster's shared
# filesystem): a --nnodes 2:3 job trains on hosts A and B, one rank each;
# once it has checkpointed, host C's launcher arrives. A and B stop their
# workers, all three meet in the next round, and the job resumes from its
# checkpoint mid-epoch with WORLD_SIZE 3, no restart used, and finishes.
#   netns_scale_up_test.sh DTRAIN_RUN TRAIN
set -euo pipefail
run=$1 train=$2
source "$(dirname "$0")/../harness/netns.sh"
netns_up 10.215.0
netns_add_third 10.215.1
A=10.215.0.1
work=$(mktemp -d)
fail() { echo "FAIL: $*"; for f in "$work"/*.log; do echo "--- $f"; tail -30 "$f"; done; exit 1; }
conf=join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3
on() {  # on NS NAME: this host's launcher of the job, in the background
  ip netns exec "$1" env OMP_NUM_THREADS=1 "$run" --nproc-per-node 1 --nnodes 2:3 --rdzv-backend c10d \
    --rdzv-endpoint $A:29631 --rdzv-id grow --rdzv-conf $conf "$train" --epochs 1 --train-limit 24000 \
    --test-limit 1000 --batch-size 32 --checkpoint-every 10 --checkpoint-dir "$work/ckpt" \
    --out-dir "$work/runs-$2" >"$work/$2.log" 2>&1 &
  NS_PIDS+=($!)
  eval "pid_$2=$!"
}
on "$NS_A" a
on "$NS_B" b
for _ in $(seq 600); do [ -f "$work/ckpt/metadata.dtt" ] && break; sleep 0.1; done
[ -f "$work/ckpt/metadata.dtt" ] || fail "the 2-host job wrote no checkpoint"
on "$NS_C" c
for n in a b c; do
  p=pid_$n
  wait "${!p}" || fail "host $n's launcher failed"
done
all="$work/a.log $work/b.log $work/c.log"
grep -qh "resumed from $work/ckpt at epoch 1, sample [1-9][0-9]* of 24000 (restart 1)" $all ||
  fail "the 3-host round did not resume from the checkpoint"
grep -qh "the checkpoint was written by 2 rank(s), now 3" $all || fail "WORLD_SIZE did not grow to 3"
grep -qh "done: test accuracy .* on 3 rank(s)" $all || fail "the 3-rank job did not finish"
grep -q "no restart used" "$work/a.log" || fail "host A did not stop for the newcomer"
echo "scale-up: $(grep -oh 'resumed from [^(]*' $all) at 3 ranks; $(grep -oh 'done: test accuracy [0-9.]*%' $all)"
rm -rf "$work"
