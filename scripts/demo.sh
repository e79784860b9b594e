#!/usr/bin/env bash
# The main job for now: 4 ranks all-reduce and broadcast, each printing what
# it sent and received, launched with dtrain-run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >/dev/null
exec ./build/tools/dtrain-run/dtrain-run --standalone --nproc-per-node 4 \
  ./build/examples/collectives_demo
