#!/usr/bin/env bash
# On the GPU machine (device tool), carrying .gpu (scripts/gpu/prepare.sh):
#   bash scripts/gpu/run.sh STAGE...
# Stages, run in the order given, each under its own time limit, each
# writing its log to $OUT (at most 8 files come back):
#   build   configure (nccl required) and build into /tmp/b
#   gpu+suite  the next two at once, and the segv loop beside them (the
#           crash it looks for came under the suite's load)
#   gpu     every test that needs a GPU: nccl_test, DeviceRouting.*,
#           DataParallel and async_save on CUDA, CudaLaunched's GPU cases
#           (DDP, FSDP, HSDP, ZeRO, SyncBatchNorm, pipelines, TP+SP+AC, EP)
#   suite   the whole ctest suite at -j16 (netns excluded: no `ip` there)
#   bench   the GPU benchmarks (dtrain-bench cuda) beside PyTorch's
#   segv    loops Nccl.DdpOnOneGpu... under cuda-gdb for SEGV_SECONDS
#           (default 150), keeping the stack of a crash
#   cpu16   16-core CPU figures beside PyTorch 2.11: tcp and auto all_reduce
#           at 2, 4, 8 and 16 ranks
#   pipe16  dtrain-bench pipeline's bubble at 2, 4 and 8 ranks
#   main16  the main job beside its PyTorch twin at 2 and 8 ranks
#   ddp16   dtrain-bench ddp at 8 ranks beside PyTorch's DDP
#   ep16    dtrain-bench ep (expert parallelism's memory at EP 2 and 4, an MoE
#           layer's tokens/s at EP 2 against one process on 2 threads)
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
    # No unity batches: 16 cores build ~100 units at once faster than ~30
    # long ones.
    bash .gpu/build.sh -DDTRAIN_WITH_NCCL=ON -DDTRAIN_UNITY_BUILD=OFF || exit 1
    grep -E "nccl backend" "$OUT/configure.log" ;;
  gpu)
    for t in "nccl_test:*" "ddp_test:DeviceRouting.*:*OnCuda" "data_parallel_test:*Cuda*" \
             "process_test:*CudaLaunched*:-*_cpu"; do
      bin=${t%%:*} filter=${t#*:}
      [ -x $B/tests/$bin ] || { echo "$bin: not built"; continue; }
      NCCL_DEBUG=WARN timeout 240 $B/tests/$bin --gtest_filter="$filter" >> "$OUT/gpu.log" 2>&1
      echo "$bin rc $?"
    done
    grep -E "^\[  (FAILED|PASSED|SKIPPED) |\[  SKIPPED \]|\[  FAILED  \]" "$OUT/gpu.log" | sort | uniq | head -40 ;;
  gpu+suite)  # all at once (the GPU tests time nothing)
    bash "$0" suite > "$OUT/suite.out" 2>&1 &
    SEGV_SECONDS=${SEGV_SECONDS:-200} bash "$0" segv > "$OUT/segv.out" 2>&1 &
    bash "$0" gpu; wait; cat "$OUT/suite.out" "$OUT/segv.out" ;;
  suite)
    (cd $B && timeout 260 ctest -j16 --timeout 250 --output-on-failure -E "netns" > "$OUT/ctest.log" 2>&1; echo "ctest rc $?")
    grep -E "tests passed|tests failed|\((Failed|Timeout|SEGFAULT|Subprocess aborted)\)" "$OUT/ctest.log"
    grep -E "\*\*\*Skipped|Not Run" "$OUT/ctest.log" | head ;;
  bench)  # item 3 (world 1, nccl) and item 4 (2 ranks sharing the GPU)
    timeout 150 $BE cuda --world 1 --runs 3 --steps 200 --baseline bench/baselines/cuda_ddp.py >> "$OUT/bench.log" 2>&1
    echo "cuda bench world 1 rc $?"
    timeout 120 $BE cuda --world 2 --runs 1 --steps 20 --baseline bench/baselines/cuda_ddp.py >> "$OUT/bench.log" 2>&1
    echo "cuda bench world 2 rc $?"
    grep -vE "^\[" "$OUT/bench.log" | tail -12 ;;
  segv)  # Nccl.DdpOnOneGpu crashed once under the suite's load: loop it
          # under cuda-gdb for SEGV_SECONDS, keep the stack of any crash
    end=$(( $(date +%s) + ${SEGV_SECONDS:-150} )) k=0
    while [ "$(date +%s)" -lt "$end" ]; do
      k=$((k + 1))
      timeout 60 cuda-gdb -batch -ex run -ex bt --args $B/tests/nccl_test \
        --gtest_filter=Nccl.DdpOnOneGpuMatchesSingleProcessTraining > "$OUT/segv-run.log" 2>&1
      if grep -q "SIGSEGV\|signal SIG" "$OUT/segv-run.log"; then cp "$OUT/segv-run.log" "$OUT/segv.log"; echo "crash at try $k"; break; fi
      grep -q "\[  PASSED  \] 1 test" "$OUT/segv-run.log" || { echo "try $k did not pass:"; tail -5 "$OUT/segv-run.log"; }
    done
    [ -f "$OUT/segv.log" ] && grep -A25 "SIGSEGV\|signal SIG" "$OUT/segv.log" | head -40 || echo "no crash in $k tries" ;;
  cpu16)
    for n in 2 4 8 16; do for be in tcp auto; do
      timeout $(( n < 16 ? 30 : 60 )) $R --standalone --nproc-per-node $n $BE collectives --backend $be --min-bytes 16777216 \
        --max-bytes 16777216 --baseline .gpu/baselines/py_allreduce.py --runs 1 >> "$OUT/coll.log" 2>&1
      echo "$be $n ranks rc $?"; grep -A8 "# all_reduce float32" "$OUT/coll.log" | grep -E "16777216" | tail -1
    done; done ;;
  pipe16)
    for n in 2 4 8; do
      timeout 60 $BE pipeline --ranks $n --run bubble --microbatches $(( n < 8 ? 8 : 16 )) >> "$OUT/pipe.log" 2>&1; echo "pipeline $n ranks rc $?"
    done
    grep -vE "^#" "$OUT/pipe.log" ;;
  main16)
    for n in 2 8; do
      DTRAIN_BUILD=$B PYTHON=python3 INTEROP_VARIANT=0 timeout 100 \
        bash bench/scripts/main_job_vs_pytorch.sh 1 1 $n >> "$OUT/main.log" 2>&1; echo "main job $n ranks rc $?"
    done
    cat "$OUT/main.log" ;;
  ep16)
    timeout 200 $BE ep --runs 1 >> "$OUT/ep.log" 2>&1; echo "ep rc $?"; grep -E "EP [24]|one process" "$OUT/ep.log" ;;
  ddp16)
    timeout 150 $BE ddp --world 8 --runs 1 --baseline .gpu/baselines/py_ddp_train.py >> "$OUT/ddp.log" 2>&1
    echo "ddp 8 ranks rc $?"; grep median "$OUT/ddp.log" | tail -1 ;;
  esac
done
stamp done
