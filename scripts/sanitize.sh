#!/usr/bin/env bash
# Builds dtrain's torch-free core (stores and their servers in both wire
# dialects, sockets and name lookup, file-store locking, shm segments, the
# environment registry, CPU-memory policy) and its unit suite with a
# sanitizer, in its own build directory, and runs the suite; any report
# fails. CI runs both modes (.ci/run).
#   scripts/sanitize.sh address   AddressSanitizer + UndefinedBehaviorSanitizer
#   scripts/sanitize.sh thread    ThreadSanitizer (the store suites: server
#                                 thread, many clients, waiters)
#   scripts/sanitize.sh address-torch
#                                 ASan+UBSan over the whole library and the
#                                 thread-rank suites (collectives, DDP,
#                                 DataParallel); ~15 min on 2 cores, so not in
#                                 CI yet. Leak checks are off: libtorch's own
#                                 allocations at exit are not ours to judge.
# Extra arguments go to the test binary (e.g. --gtest_filter=...).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: scripts/sanitize.sh address|thread [gtest args]}
shift
case $mode in
  # CpuMemory.* measures glibc malloc, which AddressSanitizer replaces.
  address) flags=address,undefined dir=build-asan filter='-CpuMemory.*' ;;
  thread) flags=thread dir=build-tsan filter='AllStores/*:TcpStore*:C10dStore*:FileStore*:PrefixStore*' ;;
  address-torch) flags=address,undefined dir=build-asan filter='*' ;;
  *) echo "sanitize.sh: unknown mode '$mode' (expected address, thread or address-torch)" >&2; exit 2 ;;
esac
targets=(unit_test)
[ "$mode" = address-torch ] && targets=(collectives_test ddp_test data_parallel_test)
bash scripts/setup.sh
echo "sanitize: configuring ./$dir (-fsanitize=$flags)"
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDTRAIN_SANITIZE="$flags" \
  -DDTRAIN_BUILD_EXAMPLES=OFF -DDTRAIN_BUILD_BENCH=OFF >/dev/null
echo "sanitize: compiling ${targets[*]}"
for t in "${targets[@]}"; do cmake --build "$dir" -j"${DTRAIN_BUILD_JOBS:-2}" --target "$t"; done
leaks=1
[ "$mode" = address-torch ] && leaks=0
export ASAN_OPTIONS=detect_leaks=$leaks:abort_on_error=0:halt_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
for t in "${targets[@]}"; do
  echo "sanitize: running $t under -fsanitize=$flags"
  "$dir/tests/$t" --gtest_filter="$filter" "$@"
done
