#!/usr/bin/env bash
# Configures and builds dtrain in ./build (after installing what is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"${DTRAIN_BUILD_JOBS:-2}"
