#!/usr/bin/env bash
# dtrain's mixture-of-experts layer (expert_parallel.h) at EP 1, 2 and 4
# against the same block written in plain PyTorch in one process on the
# whole batch (moe_vs_pytorch.py): the same initial values, data and 5
# AdamW steps, the bias updated after each. Prints, per EP size, the
# largest difference of the outputs, losses, every rank's gradient and
# parameter parts and the bias, each as a fraction of the largest value,
# and fails above 1e-5, or when the data gives no expert zero tokens on
# some rank at EP 2 and 4. CI runs it in its Debian unstable leg.
# Needs Python's torch (in the Debian unstable root: bash scripts/compat.sh
# sid bash -c 'bash scripts/build.sh dtrain-bench && bash
# bench/scripts/moe_vs_pytorch.sh build/bench/dtrain-bench').
# Usage: moe_vs_pytorch.sh DTRAIN_BENCH
set -euo pipefail
bench=$1
here=$(dirname "$0")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "mixture of experts: dtrain against plain PyTorch $(python3 -c 'import torch; print(torch.__version__)')"
python3 "$here/moe_vs_pytorch.py" run "$out/torch"
status=0
port=29781
for world in 1 2 4; do
  port=$((port + 1))
  pids=()
  for rank in $(seq $((world - 1)) -1 0); do
    env RANK=$rank WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 timeout 300 \
      "$bench" rank moe-ref --out "$out/dtrain.$world" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do
    wait "$pid" || { echo "moe_vs_pytorch: a dtrain rank of EP $world failed" >&2; exit 1; }
  done
  python3 "$here/moe_vs_pytorch.py" compare "$out/dtrain.$world" "$out/torch" $world || status=1
done
exit $status
