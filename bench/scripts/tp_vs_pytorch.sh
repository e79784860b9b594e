#!/usr/bin/env bash
# dtrain's tensor parallelism against PyTorch's (parallelize_module,
# SequenceParallel, loss_parallel, torch.utils.checkpoint; gloo on this
# machine), in one process and at TP 2 and 4: the same models, initial
# values, data and 5 AdamW steps on both sides (dtrain-bench's tp-ref mode,
# tp_vs_pytorch.py). Prints, per model, the largest difference of the
# outputs, losses, every rank's gradient shards and its parameter shards
# after the steps, each as a fraction of the largest value, and fails above
# 1e-5, or if either side's checkpointed run's losses and gradients are not
# bitwise its plain run's. CI runs it in its Debian unstable leg.
# Needs Python's torch (in the Debian unstable root: bash scripts/compat.sh
# sid bash -c 'bash scripts/build.sh dtrain-bench && bash
# bench/scripts/tp_vs_pytorch.sh build/bench/dtrain-bench').
# Usage: tp_vs_pytorch.sh DTRAIN_BENCH
set -euo pipefail
bench=$1
here=$(dirname "$0")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
port=29751
status=0
echo "tensor parallelism: dtrain against PyTorch $(python3 -c 'import torch; print(torch.__version__)')"
for world in 1 2 4; do
  for side in dtrain torch; do
    port=$((port + 1))
    pids=()
    for rank in $(seq $((world - 1)) -1 0); do
      env RANK=$rank WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port USE_LIBUV=0 \
        OMP_NUM_THREADS=1 timeout 300 \
        $([ $side = dtrain ] && echo "$bench rank tp-ref --out $out/$side.$world" \
                             || echo "python3 $here/tp_vs_pytorch.py run $out/$side.$world") &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do
      wait "$pid" || { echo "tp_vs_pytorch: a $side rank of TP $world failed" >&2; exit 1; }
    done
  done
  python3 "$here/tp_vs_pytorch.py" compare "$out/dtrain.$world" "$out/torch.$world" $world || status=1
done
exit $status
