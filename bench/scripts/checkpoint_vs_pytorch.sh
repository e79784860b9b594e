#!/usr/bin/env bash
# What a checkpoint costs training, dtrain against PyTorch: dtrain-bench
# checkpoint (save() and async_save(), bench/checkpoint.cpp) and
# torch.distributed.checkpoint's save() and async_save() on the same model
# (checkpoint_vs_pytorch.py, gloo), DDP and FSDP with Adam, 4 ranks. Prints
# both sides' figures and their stall/save and step-during/step ratios.
# Needs Python's torch 2.4 or later (in the Debian unstable root: bash
# scripts/compat.sh sid bash -c 'bash scripts/build.sh dtrain-bench && bash
# bench/scripts/checkpoint_vs_pytorch.sh build/bench/dtrain-bench').
# Usage: checkpoint_vs_pytorch.sh DTRAIN_BENCH [LAYERS WIDTH [SAVES [DIR]]]
set -euo pipefail
bench=$(realpath "$1")
layers=${2:-6} width=${3:-4096} saves=${4:-3} dir=${5:-/tmp/dtrain-checkpoint-vs-pytorch}
here=$(cd "$(dirname "$0")" && pwd)
world=4 steps=5
echo "checkpoint stall: dtrain against PyTorch $(python3 -c 'import torch; print(torch.__version__)'), $world ranks, $layers x Linear($width, $width), Adam, medians of $saves saves"
"$bench" checkpoint --world $world --layers "$layers" --width "$width" --saves "$saves" --steps $steps --dir "$dir"
printf '%-19s %10s %9s %9s %11s %9s %9s %12s %9s %7s\n' side/mode state_MiB step_s save_s 1st_stall_s stall_s write_s step_during xsave xstep
port=29811
for mode in ddp fsdp; do
  rm -rf "$dir"
  port=$((port + 1))
  pids=()
  log=$(mktemp)
  for rank in $(seq $((world - 1)) -1 0); do
    env RANK=$rank WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port USE_LIBUV=0 OMP_NUM_THREADS=1 \
      timeout 1200 python3 "$here/checkpoint_vs_pytorch.py" $mode "$dir" "$layers" "$width" "$saves" $steps >>"$log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do
    wait "$pid" || { cat "$log"; echo "checkpoint_vs_pytorch: a PyTorch rank ($mode) failed" >&2; exit 1; }
  done
  grep '^result' "$log" | python3 -c '
import sys
f = dict(kv.split("=") for kv in sys.stdin.read().split()[1:])
v = {k: float(x) for k, x in f.items()}
print("%-19s %10.1f %9.3f %9.3f %11.3f %9.3f %9.3f %12.3f %9.3f %7.3f" % (sys.argv[1],
      v["state_bytes"] / 2**20, v["step"], v["save"], v["first_stall"], v["stall"], v["write"],
      v["step_during"], v["stall"] / v["save"], v["step_during"] / v["step"]))' "torch/$mode"
  rm -f "$log"
done
rm -rf "$dir"
