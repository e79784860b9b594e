#!/usr/bin/env bash
# The GPU issue's part B, as two calls of the device tool (each < 10 min):
#   bash .gpu/part-b.sh tests  - build; nccl_test on the GPU; the whole ctest
#                                suite on PyTorch's libtorch (netns excepted:
#                                no `ip` there); Fashion-MNIST on the GPU and
#                                on the CPU
#   bash .gpu/part-b.sh bench  - dtrain-bench ddp at 2 and 8 ranks and tcp
#                                all_reduce at 2, 4, 8, 16 ranks, side by side
#                                with PyTorch's own DDP and gloo
# Logs land in $OUT (at most 8 files come back).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
[ -x /tmp/b/tools/dtrain-run/dtrain-run ] || bash .gpu/build.sh || exit 1
B=/tmp/b R=/tmp/b/tools/dtrain-run/dtrain-run BE=/tmp/b/bench/dtrain-bench FM=/tmp/b/examples/dtrain-fashion-mnist
case "${1:-tests}" in
tests)
  NCCL_DEBUG=WARN timeout 150 $B/tests/nccl_test > $OUT/nccl.log 2>&1; echo "nccl_test rc $?"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |OK \]" $OUT/nccl.log | head -30
  (cd $B && timeout 240 ctest -j16 --timeout 120 -E "netns|^Nccl|NcclDtypes" > $OUT/ctest.log 2>&1; echo "ctest rc $?")
  grep -E "tests passed|tests failed|\((Failed|Timeout|SEGFAULT)\)" $OUT/ctest.log
  for d in cuda cpu; do
    b=auto; [ $d = cuda ] && b=nccl
    timeout 100 $R --standalone --nproc-per-node 1 $FM --backend $b --device $d --epochs 2 \
      --out-dir /tmp/fm-$d >> $OUT/fm.log 2>&1; echo "fashion-mnist $d rc $?"
    grep -E "done:" $OUT/fm.log | tail -1
  done ;;
bench)
  for n in 2 8; do
    timeout 120 $BE ddp --world $n --runs 2 --baseline .gpu/baselines/py_ddp_train.py >> $OUT/ddp.log 2>&1
    echo "ddp $n rc $?"; grep median $OUT/ddp.log | tail -1
  done
  for n in 2 4 8 16; do
    timeout 60 $R --standalone --nproc-per-node $n $BE collectives --backend tcp --min-bytes 16777216 \
      --max-bytes 16777216 --baseline .gpu/baselines/py_allreduce.py --runs 2 >> $OUT/coll.log 2>&1
    echo "tcp $n ranks rc $?"; grep -A8 "# all_reduce float32" $OUT/coll.log | grep -E "^ +16777216" | tail -1
  done ;;
esac
