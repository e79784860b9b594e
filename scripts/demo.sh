#!/usr/bin/env bash
# The main job for now: 4 ranks all-reduce and broadcast, each printing what
# it sent and received. Launched with PyTorch's torchrun from Debian's
# python3-torch (dtrain's own launcher, dtrain-run, is on its way).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >/dev/null
# --redirects/--tee 2: Debian's torchrun 1.13 on Python 3.11 cannot parse its
# default of 0; 2 tees stderr and leaves stdout as is.
exec torchrun --standalone --nproc_per_node 4 --redirects 2 --tee 2 \
  --no_python ./build/examples/collectives_demo
