#!/usr/bin/env bash
# The main job (dtrain's Fashion-MNIST example, RANKS ranks) beside a PyTorch
# Python version of it (bench/baselines/fashion_mnist_ddp.py: same model,
# data, sampler order, optimizer; PyTorch's DDP over gloo), EPOCHS epochs each
# (default 1), interleaved RUNS times (default 2), with the Python job's
# thread settings varied: ATen's default inter-op pool, and one inter-op
# thread (INTEROP_VARIANT=0 leaves the second out). Prints each run's
# samples/s and threads. Run from a built tree:
#   bash bench/scripts/main_job_vs_pytorch.sh [EPOCHS] [RUNS] [RANKS]
# DTRAIN_BUILD names the build folder (default build/), PYTHON the
# interpreter with torch (default /usr/bin/python3).
# (in Debian unstable's root: bash scripts/compat.sh sid bash bench/scripts/main_job_vs_pytorch.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
epochs=${1:-1} runs=${2:-2} ranks=${3:-2}
tree=$PWD
build=${DTRAIN_BUILD:-$tree/build}
python=${PYTHON:-/usr/bin/python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
echo "# $("$python" -c 'import torch; print("PyTorch", torch.__version__)'), $(nproc) cores, $epochs epoch(s), $ranks ranks"
for run in $(seq "$runs"); do
  echo "## run $run"
  "$build/tools/dtrain-run/dtrain-run" --standalone --nproc-per-node "$ranks" \
    "$build/examples/dtrain-fashion-mnist" --epochs "$epochs" --checkpoint-every 0 2>&1 |
    grep -E "^(\[0\]:)?(epoch [0-9]+/|done)" | sed 's/^/dtrain: /'
  USE_LIBUV=0 "$python" "$tree/bench/baselines/fashion_mnist_ddp.py" --nproc "$ranks" --epochs "$epochs" 2>&1 |
    grep -E "^(epoch [0-9]+/|total train|threads)" | sed 's/^/pytorch (default threads): /'
  [ "${INTEROP_VARIANT:-1}" = 0 ] && continue
  USE_LIBUV=0 "$python" "$tree/bench/baselines/fashion_mnist_ddp.py" --nproc "$ranks" --epochs "$epochs" --interop-threads 1 2>&1 |
    grep -E "^(epoch [0-9]+/|total train|threads)" | sed 's/^/pytorch (1 inter-op thread): /'
done
