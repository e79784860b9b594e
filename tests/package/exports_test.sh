#!/usr/bin/env bash
# dtrain next to PyTorch's own libtorch 2.x: those builds export what they
# bundle (gloo, std::filesystem, libuv, MKL, miniz, ...), and any reference
# from a dtrain binary to such a symbol would bind to libtorch's copy.
#  1. No installed binary and no test program has an undefined dynamic
#     reference to those families (nm -D --undefined-only).
#  2. A 2-rank training job (tcp backend, data loading, checkpoints) runs
#     with a preloaded library that defines every std::filesystem and common
#     libuv function as a trap, as libtorch 2.x's exports would; a control
#     program that does use std::filesystem must hit the trap.
# Usage: exports_test.sh BUILD_DIR
set -euo pipefail
build=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cmake --install "$build" --prefix "$work/prefix" >/dev/null
files=("$work"/prefix/lib/libdtrain.so* "$work"/prefix/bin/*)
while IFS= read -r f; do files+=("$f"); done < <(
  find "$build/tests" -maxdepth 3 -type f -perm -u+x \( -name '*_test' -o -name rank_worker \))

# Mangled or C names of the families libtorch 2.x exports.
families='4gloo|St10filesystem| uv_| mkl_| cblas_| [sdcz]gemm_| mz_| tdefl_| tinfl_|Sleef_|tensorpipe| xnn_|libkineto|fbgemm| nnp_| cpuinfo_| pthreadpool_|[0-9]google'
bad=0 checked=0
for f in "${files[@]}"; do
  [ -L "$f" ] && continue
  refs=$(nm -D --undefined-only "$f" 2>/dev/null | grep -E "$families" || true)
  checked=$((checked + 1))
  if [ -n "$refs" ]; then
    echo "exports: $f references symbols libtorch 2.x bundles:"
    echo "$refs" | head -20
    bad=1
  fi
done
[ "$checked" -ge 8 ] || { echo "exports: only $checked binaries found to check"; exit 1; }
[ "$bad" -eq 0 ] || exit 1
echo "exports: $checked binaries reference nothing libtorch bundles"

# The trap library: every std::filesystem function libstdc++ defines, and
# the libuv entry points a TCP program would use, each aborting loudly.
libstdcxx=$(g++ -print-file-name=libstdc++.so.6)
{
  echo '#include <stdio.h>'
  echo '#include <stdlib.h>'
  echo 'static void trap(const char* n) { fprintf(stderr, "TRAP: %s bound to the preloaded copy\n", n); abort(); }'
  nm -D --defined-only "$libstdcxx" | awk '$2 == "T" {print $3}' | sed 's/@.*//' \
    | grep 'St10filesystem' | sort -u | while read -r s; do echo "void $s(void) { trap(\"$s\"); }"; done
  for s in uv_loop_init uv_run uv_close uv_tcp_init uv_listen uv_accept uv_read_start uv_write; do
    echo "void $s(void) { trap(\"$s\"); }"
  done
} >"$work/traps.c"
gcc -shared -fPIC -o "$work/libtraps.so" "$work/traps.c"
[ "$(grep -c 'St10filesystem' "$work/traps.c")" -ge 20 ] || { echo "exports: too few traps"; exit 1; }

# Control: a program that uses std::filesystem falls into the trap.
printf '#include <filesystem>\nint main() { return std::filesystem::exists("/") ? 0 : 1; }\n' \
  >"$work/control.cpp"
g++ -std=c++17 -o "$work/control" "$work/control.cpp"
if LD_PRELOAD="$work/libtraps.so" "$work/control" 2>"$work/control.err"; then
  echo "exports: the control program did not hit the trap"; exit 1
fi
grep -q "TRAP: _ZNSt10filesystem" "$work/control.err"

# The job itself, installed, with the traps preloaded.
cd "$work"
LD_PRELOAD="$work/libtraps.so" timeout 300 prefix/bin/dtrain-run --standalone --nproc-per-node 2 \
  prefix/bin/dtrain-fashion-mnist --backend tcp --epochs 1 --train-limit 1024 --test-limit 512 \
  --checkpoint-dir "$work/ckpt" --out-dir "$work/run" >"$work/job.out" 2>&1 \
  || { cat "$work/job.out"; echo "exports: the job failed with the traps preloaded"; exit 1; }
grep -q "done: test accuracy" "$work/job.out" || { cat "$work/job.out"; exit 1; }
test -f "$work/ckpt/metadata.dtt"
ls "$work/ckpt"/data-*-1.dtt >/dev/null
echo "exports: a 2-rank tcp job ran with std::filesystem and libuv trapped"
