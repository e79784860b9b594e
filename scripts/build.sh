#!/usr/bin/env bash
# Configures and builds dtrain in ./build (after installing what is missing).
# Arguments are CMake targets to build (default: everything); the build
# shows CMake's own [n/N] progress lines.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "build: configuring ./build"
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
targets=()
for t in "$@"; do targets+=(--target "$t"); done
echo "build: compiling ${*:-everything} (-j${DTRAIN_BUILD_JOBS:-2})"
cmake --build build -j"${DTRAIN_BUILD_JOBS:-2}" "${targets[@]}"
