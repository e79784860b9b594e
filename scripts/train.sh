#!/usr/bin/env bash
# The main job: 2 ranks train a convnet on Fashion-MNIST (Debian's
# dataset-fashion-mnist) with DistributedDataParallel, launched by dtrain-run.
# Shows a progress bar, prints per-epoch loss/accuracy/throughput, and leaves
# runs/<date-time>/{metrics.jsonl,training.png} and checkpoints/checkpoint.dtt.
# Extra arguments go to the program, e.g.: bash scripts/train.sh --epochs 2
set -euo pipefail
cd "$(dirname "$0")/.."
# Only what the main job needs: the library, the launcher and the example.
bash scripts/build.sh dtrain-run dtrain-fashion-mnist
exec ./build/tools/dtrain-run/dtrain-run --standalone --nproc-per-node 2 --max-restarts 1 \
  ./build/examples/dtrain-fashion-mnist "$@"
