#!/usr/bin/env bash
# Builds dtrain's torch-free core (stores and their servers in both wire
# dialects, sockets and name lookup, file-store locking, shm segments, the
# environment registry, CPU-memory policy) and its unit suite with a
# sanitizer, in its own build directory, and runs the suite; any report
# fails. CI runs both modes (.ci/run).
#   scripts/sanitize.sh address   AddressSanitizer + UndefinedBehaviorSanitizer
#   scripts/sanitize.sh thread    ThreadSanitizer (the store suites: server
#                                 thread, many clients, waiters)
# Extra arguments go to the test binary (e.g. --gtest_filter=...).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: scripts/sanitize.sh address|thread [gtest args]}
shift
case $mode in
  # CpuMemory.* measures glibc malloc, which AddressSanitizer replaces.
  address) flags=address,undefined dir=build-asan filter='-CpuMemory.*' ;;
  thread) flags=thread dir=build-tsan filter='AllStores/*:TcpStore*:C10dStore*:FileStore*:PrefixStore*' ;;
  *) echo "sanitize.sh: unknown mode '$mode' (expected address or thread)" >&2; exit 2 ;;
esac
bash scripts/setup.sh
echo "sanitize: configuring ./$dir (-fsanitize=$flags)"
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDTRAIN_SANITIZE="$flags" \
  -DDTRAIN_BUILD_EXAMPLES=OFF -DDTRAIN_BUILD_BENCH=OFF >/dev/null
echo "sanitize: compiling unit_test"
cmake --build "$dir" -j"${DTRAIN_BUILD_JOBS:-2}" --target unit_test
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:halt_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
echo "sanitize: running unit_test under -fsanitize=$flags"
"$dir/tests/unit_test" --gtest_filter="$filter" "$@"
