#!/usr/bin/env bash
# The whole test suite on a fresh machine: setup, build, ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/build.sh
built=$(date +%s)
ctest --test-dir build --output-on-failure --timeout 600 -j"${DTRAIN_TEST_JOBS:-2}" "$@"
echo "test.sh: build $((built - start)) s, tests $(( $(date +%s) - built )) s"
