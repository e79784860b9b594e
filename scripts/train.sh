#!/usr/bin/env bash
# The main job: 2 ranks train a convnet on Fashion-MNIST (Debian's
# dataset-fashion-mnist) with DistributedDataParallel, launched by dtrain-run.
# Shows a progress bar, prints per-epoch loss/accuracy/throughput, and leaves
# runs/<date-time>/{metrics.jsonl,training.png} and checkpoints/ (a distributed checkpoint).
#   bash scripts/train.sh [--nproc-per-node N] [program arguments...]
# --nproc-per-node (first, default 2) goes to dtrain-run; the rest to the
# program, e.g.: bash scripts/train.sh --epochs 2, or
# bash scripts/train.sh --nproc-per-node 3 --resume (a checkpoint of any size).
set -euo pipefail
cd "$(dirname "$0")/.."
nproc=2
if [ "${1:-}" = "--nproc-per-node" ]; then
  [ $# -ge 2 ] || { echo "train.sh: --nproc-per-node needs a number" >&2; exit 2; }
  nproc=$2
  shift 2
fi
# Only what the main job needs: the library, the launcher and the example.
bash scripts/build.sh --main dtrain-run dtrain-fashion-mnist
exec ./build/tools/dtrain-run/dtrain-run --standalone --nproc-per-node "$nproc" --max-restarts 1 \
  ./build/examples/dtrain-fashion-mnist "$@"
