#!/usr/bin/env bash
# Builds dtrain's libFuzzer harnesses with clang under AddressSanitizer +
# UndefinedBehaviorSanitizer (./build-fuzz) and runs each for a while,
# starting from its committed seed corpus (fuzz/corpus/<harness>/). Any
# crash, sanitizer report or hang fails; the input that caused it is left
# in ./build-fuzz/artifacts/.
#   scripts/fuzz.sh [seconds per harness, default 60]
# CI runs it with the default; run it longer to search harder. New inputs
# that reach new code go to ./build-fuzz/corpus/<harness>/ (not the
# committed corpus: copy the ones worth keeping, and every input that
# found a bug, into fuzz/corpus/<harness>/ by hand).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
harnesses=(store_server_fuzz c10d_scan_fuzz file_store_fuzz launcher_options_fuzz tensor_file_fuzz safetensors_fuzz idx_reader_fuzz checkpoint_fuzz trace_dump_fuzz
           distributed_checkpoint_fuzz error_file_fuzz transport_frames_fuzz snapshot_keeper_fuzz ft_protocol_fuzz)
bash scripts/setup.sh main clang libclang-rt-14-dev  # clang and its libFuzzer
echo "fuzz: configuring ./build-fuzz (clang, -fsanitize=fuzzer,address,undefined)"
CC=clang CXX=clang++ bash scripts/configure.sh build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DDTRAIN_SANITIZE=address,undefined -DDTRAIN_BUILD_FUZZERS=ON -DDTRAIN_BUILD_TESTS=OFF \
  -DDTRAIN_BUILD_EXAMPLES=OFF -DDTRAIN_BUILD_BENCH=OFF -DDTRAIN_WITH_NCCL=OFF
cmake --build build-fuzz -j"${DTRAIN_BUILD_JOBS:-2}" --target "${harnesses[@]}"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:halt_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
mkdir -p build-fuzz/artifacts
# Each harness is one process on one core: two run at once, each for the
# whole of its time.
jobs=${DTRAIN_FUZZ_JOBS:-2}
run_one() {  # harness; its log is build-fuzz/<name>.log, its exit status in .rc
  local h=$1 name=${1%_fuzz} rc=0
  mkdir -p "build-fuzz/corpus/$name"
  "build-fuzz/fuzz/$h" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 \
    -print_final_stats=1 -artifact_prefix="build-fuzz/artifacts/$name-" \
    "build-fuzz/corpus/$name" "fuzz/corpus/$name" >"build-fuzz/$name.log" 2>&1 || rc=$?
  echo "$rc" >"build-fuzz/$name.rc"
}
report() {  # harness: show the start, the end and any report; fail on a finding
  local h=$1 name=${1%_fuzz} rc
  rc=$(cat "build-fuzz/$name.rc")
  echo "fuzz: $h ran for $seconds s"
  grep -v -E '^#[0-9]+' "build-fuzz/$name.log" | tail -40
  grep -E '^#[0-9]+.*DONE' "build-fuzz/$name.log" || true
  [ "$rc" -eq 0 ] || { echo "fuzz: $h failed (exit $rc); the input is in build-fuzz/artifacts/"; return 1; }
}
failed=0
for ((i = 0; i < ${#harnesses[@]}; i += jobs)); do
  batch=("${harnesses[@]:i:jobs}")
  echo "fuzz: running ${batch[*]} for $seconds s"
  for h in "${batch[@]}"; do run_one "$h" & done
  wait
  for h in "${batch[@]}"; do report "$h" || failed=1; done
done
exit $failed
