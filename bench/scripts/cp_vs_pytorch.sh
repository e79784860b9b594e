#!/usr/bin/env bash
# dtrain's ring and Ulysses attention (context_parallel.h) at CP 2 and 4,
# head-tail sharding, against PyTorch's F.scaled_dot_product_attention over
# the whole sequence in one process (cp_vs_pytorch.py): causal,
# grouped-query (4 q heads, 2 kv heads), sequence 4096, fp32. Prints, per
# method and CP size, the largest difference of the output and of q, k
# and v's gradients as a fraction of the largest value, and fails above
# 1e-5. CI runs it in its Debian unstable leg.
# Needs Python's torch (in the Debian unstable root: bash scripts/compat.sh
# sid bash -c 'bash scripts/build.sh dtrain-bench && bash
# bench/scripts/cp_vs_pytorch.sh build/bench/dtrain-bench').
# Usage: cp_vs_pytorch.sh DTRAIN_BENCH [SEQ]
set -euo pipefail
bench=$1
length=${2:-4096}
here=$(dirname "$0")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "context parallelism: dtrain against PyTorch $(python3 -c 'import torch; print(torch.__version__)')'s scaled_dot_product_attention"
status=0
port=29791
for world in 2 4; do
  port=$((port + 1))
  pids=()
  for rank in $(seq $((world - 1)) -1 0); do
    env RANK=$rank WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 timeout 300 \
      "$bench" rank context-ref --seq "$length" --out "$out/dtrain.$world" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do
    wait "$pid" || { echo "cp_vs_pytorch: a dtrain rank of CP $world failed" >&2; exit 1; }
  done
  python3 "$here/cp_vs_pytorch.py" compare "$out/dtrain.$world" $world "$length" || status=1
done
exit $status
