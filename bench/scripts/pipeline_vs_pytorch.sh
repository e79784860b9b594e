#!/usr/bin/env bash
# dtrain's ScheduleGPipe and Schedule1F1B against PyTorch's
# torch.distributed.pipelining (gloo), two ranks on this machine, the same
# model, initial values, data and SGD steps (dtrain-bench's pp-ref mode and
# pipeline_vs_pytorch.py): prints, per stage, the largest difference of the
# final parameters as a fraction of the largest, and fails above 1e-5.
# Needs Python's torch (in the Debian unstable root: bash scripts/compat.sh
# sid bash -c 'bash scripts/build.sh dtrain-bench && bash
# bench/scripts/pipeline_vs_pytorch.sh build/bench/dtrain-bench').
# Usage: pipeline_vs_pytorch.sh DTRAIN_BENCH
set -euo pipefail
bench=$1
here=$(dirname "$0")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
port=29731
status=0
for schedule in gpipe 1f1b; do
  for side in dtrain torch; do
    port=$((port + 1))
    for rank in 1 0; do
      env RANK=$rank WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port USE_LIBUV=0 \
        OMP_NUM_THREADS=1 timeout 120 \
        $([ $side = dtrain ] && echo "$bench rank pp-ref --schedule $schedule --out $out/$side" \
                             || echo "python3 $here/pipeline_vs_pytorch.py run $schedule $out/$side") &
    done
    wait
  done
  echo "$schedule: dtrain against PyTorch $(python3 -c 'import torch; print(torch.__version__)')"
  python3 "$here/pipeline_vs_pytorch.py" compare "$out/dtrain" "$out/torch" || status=1
done
exit $status
