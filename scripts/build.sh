#!/usr/bin/env bash
# Configures and builds dtrain in ./build (after installing what is missing).
#   bash scripts/build.sh [targets...]          everything, or these targets,
#                                               with the tests and benchmarks
#   bash scripts/build.sh --main [targets...]   the main job's packages only
#                                               (scripts/setup.sh main), and a
#                                               build without tests and benchmarks
# The build shows its [n/N] progress lines (Ninja's, or make's percentages).
set -euo pipefail
cd "$(dirname "$0")/.."
purpose=test
with_tests=ON
if [ "${1:-}" = "--main" ]; then
  purpose=main
  with_tests=OFF
  shift
fi
bash scripts/setup.sh "$purpose"
start=$(date +%s)
echo "build: configuring ./build"
bash scripts/configure.sh build -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DDTRAIN_BUILD_TESTS=$with_tests -DDTRAIN_BUILD_BENCH=$with_tests
targets=()
for t in "$@"; do targets+=(--target "$t"); done
echo "build: compiling ${*:-everything} (-j${DTRAIN_BUILD_JOBS:-2})"
cmake --build build -j"${DTRAIN_BUILD_JOBS:-2}" "${targets[@]}"
echo "build: done in $(( $(date +%s) - start )) s"
