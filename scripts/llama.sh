#!/usr/bin/env bash
# The Llama example: a small Llama-style decoder (RMSNorm, rotary embeddings,
# causal attention, SwiGLU) learns to write fortunes, byte by byte, from the
# text Debian's fortunes package ships, under dtrain-run in any layout of
# its ranks (examples/llama/train.cpp, README.md's section). Shows progress,
# prints the loss, leaves runs/llama-<date-time>/{metrics.jsonl,loss.png}
# and checkpoints/llama (a distributed checkpoint), and ends with sample text.
#   bash scripts/llama.sh [--nproc-per-node N] [program arguments...]
# e.g. bash scripts/llama.sh --tp 2                     (2 ranks, tensor parallel)
#      bash scripts/llama.sh --nproc-per-node 8 --tp 2 --pp 2 --dp 2 --sequence-parallel
#      bash scripts/llama.sh --resume --steps 400      (continue, in any layout)
set -euo pipefail
cd "$(dirname "$0")/.."
nproc=2
if [ "${1:-}" = "--nproc-per-node" ]; then
  [ $# -ge 2 ] || { echo "llama.sh: --nproc-per-node needs a number" >&2; exit 2; }
  nproc=$2
  shift 2
fi
bash scripts/setup.sh only fortunes
bash scripts/build.sh --main dtrain-run dtrain-llama
exec ./build/tools/dtrain-run/dtrain-run --standalone --nproc-per-node "$nproc" --max-restarts 1 \
  ./build/examples/dtrain-llama "$@"
