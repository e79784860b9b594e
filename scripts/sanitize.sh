#!/usr/bin/env bash
# Builds dtrain with a sanitizer, in its own build directory, and runs a
# suite under it; any report fails. CI runs every mode (.ci/run).
#   scripts/sanitize.sh address   AddressSanitizer + UndefinedBehaviorSanitizer
#                                 over the torch-free core (stores and their
#                                 servers in both wire dialects, sockets and
#                                 name lookup, file-store locking, shm
#                                 segments, the environment registry) and its
#                                 unit suite, leak checks on
#   scripts/sanitize.sh address-torch
#                                 ASan+UBSan over the whole library and the
#                                 thread-rank suites (collectives on every
#                                 backend, the dtype matrix at world sizes 1
#                                 to 3; DDP, DataParallel, tensor parallelism,
#                                 activation checkpointing, fault tolerance's
#                                 Manager); leak checks
#                                 off: libtorch's own allocations at exit are
#                                 not ours to judge. About 9 min on 2 cores
#                                 from nothing (most of it compiling), 4
#                                 with ccache.
#   scripts/sanitize.sh thread    ThreadSanitizer over the store suites (server
#                                 thread, many clients, waiters, limits), the
#                                 shm segments and rings, and the snapshot
#                                 keeper (a thread per connection), the fault-
#                                 tolerance lighthouse (its quorum thread,
#                                 replicas' heartbeats). Not over libtorch: a
#                                 process that loads Debian's uninstrumented
#                                 libtorch 1.13 built with -fsanitize=thread
#                                 dies in the dynamic loader (a relocation in
#                                 one of its ~100 dependencies, before TSan
#                                 starts), so shm collectives, the DDP reducer
#                                 and DataParallel are covered by ASan only.
# Extra arguments go to the test binary (e.g. --gtest_filter=...).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: scripts/sanitize.sh address|thread [gtest args]}
shift
case $mode in
  # CpuMemory.* measures glibc malloc, which AddressSanitizer replaces.
  address) flags=address,undefined dir=build-asan filter='-CpuMemory.*' ;;
  # A keeper test that measures resident memory: ThreadSanitizer's shadow
  # memory is resident too.
  thread) flags=thread dir=build-tsan filter='AllStores/*:TcpStore*:C10dStore*:FileStore*:PrefixStore*:StoreLimits*:StoreToken*:StoreScale*:ShmSegment*:RingLink*:Topology*:SnapshotKeeper*:Ft*-SnapshotKeeper.APartCostsItsSizeOnceAndAPartPastTheLimitNothing' ;;
  # The every-dtype matrix at world sizes 2 and 3 (4 and 5 take the same
  # code paths and most of the time: CI's budget).
  # Resident memory after a thousand group rebuilds: AddressSanitizer's
  # quarantine keeps freed memory resident by design.
  address-torch) flags=address,undefined dir=build-asan filter='-*_world4_*:*_world5_*:FaultTolerance.AThousandGroupRebuilds*' ;;
  *) echo "sanitize.sh: unknown mode '$mode' (expected address, thread or address-torch)" >&2; exit 2 ;;
esac
targets=(unit_test)
[ "$mode" = address-torch ] && targets=(collectives_test ddp_test data_parallel_test tensor_parallel_test ft_test)
bash scripts/setup.sh test
echo "sanitize: configuring ./$dir (-fsanitize=$flags)"
# No NCCL: nothing here can run it (no GPU); keeps CI's build short.
bash scripts/configure.sh "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDTRAIN_SANITIZE="$flags" \
  -DDTRAIN_BUILD_EXAMPLES=OFF -DDTRAIN_BUILD_BENCH=OFF -DDTRAIN_WITH_NCCL=OFF
echo "sanitize: compiling ${targets[*]}"
cmake --build "$dir" -j"${DTRAIN_BUILD_JOBS:-2}" --target "${targets[@]}"
leaks=1
[ "$mode" = address-torch ] && leaks=0
export ASAN_OPTIONS=detect_leaks=$leaks:abort_on_error=0:halt_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
# Two gtest shards at once: most of a suite's time under a sanitizer is
# ranks waiting for each other, which the second core can overlap.
run_shards() {
  local bin=$1 rc=0 k
  shift
  for k in 0 1; do
    GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$k "$bin" "$@" >"$dir/shard-$k.log" 2>&1 &
  done
  for k in 0 1; do wait -n || rc=1; done
  cat "$dir/shard-0.log" "$dir/shard-1.log"
  return $rc
}
for t in "${targets[@]}"; do
  echo "sanitize: running $t under -fsanitize=$flags"
  run_shards "$dir/tests/$t" --gtest_filter="$filter" "$@"
done
