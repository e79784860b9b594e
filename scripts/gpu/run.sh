#!/usr/bin/env bash
# On the GPU machine (device tool), carrying .gpu (scripts/gpu/prepare.sh):
#   bash scripts/gpu/run.sh STAGE...
# Stages, run in the order given, each under its own time limit, each
# writing its log to $OUT (at most 8 files come back):
#   build   configure (nccl required) and build into /tmp/b
#   gpu+suite  the next two at once
#   gpu     every test that needs a GPU: nccl_test, DeviceRouting.*,
#           DataParallel on CUDA, the CUDA sharding tests
#   suite   the whole ctest suite at -j16 (netns excluded: no `ip` there)
#   bench   the GPU benchmarks (dtrain-bench cuda) beside PyTorch's
#   segv    loops Nccl.DdpOnOneGpu... under cuda-gdb beside other GPU tests
#   cpu16   16-core CPU figures beside PyTorch 2.11: tcp and auto all_reduce
#           at 2, 4, 8 and 16 ranks, DDP at 8 ranks
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1 USE_LIBUV=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=/tmp/b R=/tmp/b/tools/dtrain-run/dtrain-run BE=/tmp/b/bench/dtrain-bench
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
for stage in "$@"; do
  stamp "stage $stage"
  case $stage in
  build)
    nvidia-smi -L; nproc
    bash .gpu/build.sh -DDTRAIN_WITH_NCCL=ON || exit 1
    grep -E "nccl backend" "$OUT/configure.log" ;;
  gpu)
    for t in "nccl_test:*" "ddp_test:DeviceRouting.*" "data_parallel_test:*Cuda*" \
             "collectives_test:*Nccl*" "process_test:*CudaLaunched*"; do
      bin=${t%%:*} filter=${t#*:}
      [ -x $B/tests/$bin ] || { echo "$bin: not built"; continue; }
      NCCL_DEBUG=WARN timeout 200 $B/tests/$bin --gtest_filter="$filter" >> "$OUT/gpu.log" 2>&1
      echo "$bin rc $?"
    done
    grep -E "^\[  (FAILED|PASSED|SKIPPED) |\[  SKIPPED \]|\[  FAILED  \]" "$OUT/gpu.log" | sort | uniq | head -40 ;;
  gpu+suite)  # both at once (the GPU tests time nothing)
    bash "$0" suite > "$OUT/suite.out" 2>&1 & bash "$0" gpu; wait; cat "$OUT/suite.out" ;;
  suite)
    (cd $B && timeout 200 ctest -j16 --timeout 150 --output-on-failure -E "netns" > "$OUT/ctest.log" 2>&1; echo "ctest rc $?")
    grep -E "tests passed|tests failed|\((Failed|Timeout|SEGFAULT|Subprocess aborted)\)" "$OUT/ctest.log"
    grep -E "\*\*\*Skipped|Not Run" "$OUT/ctest.log" | head ;;
  bench)  # item 3 (world 1, nccl) and item 4 (2 ranks sharing the GPU)
    timeout 150 $BE cuda --world 1 --runs 2 --baseline bench/baselines/cuda_ddp.py >> "$OUT/bench.log" 2>&1
    echo "cuda bench world 1 rc $?"
    timeout 120 $BE cuda --world 2 --runs 1 --steps 20 --baseline bench/baselines/cuda_ddp.py >> "$OUT/bench.log" 2>&1
    echo "cuda bench world 2 rc $?"
    grep -vE "^\[" "$OUT/bench.log" | tail -12 ;;
  segv)  # Nccl.DdpOnOneGpu crashed once under the suite's load: loop it
          # under cuda-gdb while the GPU tests run beside it, keep any stack
    (for k in 1 2 3; do $B/tests/nccl_test > /dev/null 2>&1; $B/tests/ddp_test --gtest_filter='DeviceRouting.*' \
       > /dev/null 2>&1; done) &
    for k in $(seq 1 20); do
      timeout 60 cuda-gdb -batch -ex run -ex bt --args $B/tests/nccl_test \
        --gtest_filter=Nccl.DdpOnOneGpuMatchesSingleProcessTraining > "$OUT/segv-run.log" 2>&1
      if grep -q "SIGSEGV\|signal SIG" "$OUT/segv-run.log"; then cp "$OUT/segv-run.log" "$OUT/segv.log"; echo "crash at try $k"; break; fi
    done
    wait; [ -f "$OUT/segv.log" ] && grep -A25 "SIGSEGV\|signal SIG" "$OUT/segv.log" | head -40 || echo "no crash in 20 tries" ;;
  cpu16)
    for n in 2 4 8 16; do for be in tcp auto; do
      timeout 30 $R --standalone --nproc-per-node $n $BE collectives --backend $be --min-bytes 16777216 \
        --max-bytes 16777216 --baseline .gpu/baselines/py_allreduce.py --runs 1 >> "$OUT/coll.log" 2>&1
      echo "$be $n ranks rc $?"; grep -A8 "# all_reduce float32" "$OUT/coll.log" | grep -E "16777216" | tail -1
    done; done
    timeout 150 $BE ddp --world 8 --runs 1 --baseline .gpu/baselines/py_ddp_train.py >> "$OUT/ddp.log" 2>&1
    echo "ddp 8 ranks rc $?"; grep median "$OUT/ddp.log" | tail -1 ;;
  esac
done
stamp done
