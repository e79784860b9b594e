#!/usr/bin/env bash
# Packaging hygiene: a consumer project builds and runs against dtrain
#  1. find_package from an installed prefix that was then moved (relocatable),
#  2. find_package straight from the build tree,
#  3. add_subdirectory of the source tree (dtrain's tests must not build).
# Usage: package_test.sh SOURCE_DIR BUILD_DIR find|subdirectory
# (two ctest tests: "find" is 1 and 2, with the installed tools; the
# subdirectory compiles the library again, and CI's Debian unstable leg
# leaves it out: libtorch's version does not change how CMake takes a
# subproject, and the library already compiled there).
set -euo pipefail
src=$1 build=$2 part=$3
# A fixed folder inside the build tree, not a fresh temporary one: the
# consumers' builds then compile with the same paths each time, so ccache
# (CI points CCACHE_BASEDIR at the checkout) serves them on the next run.
work=$build/package-test-$part
rm -rf "$work"
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
consumer=$src/tests/package/consumer
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# dtrain as a subproject compiles with its precompiled headers; without this
# sloppiness ccache compiles those units but never caches them (the top
# CMakeLists.txt sets it for dtrain's own build, not for a parent's launcher).
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
# The consumer finds libtorch as its user would: at the libtorch dtrain was
# built against (outside the default paths for PyTorch's own libtorch).
torch_dir=$(sed -n 's/^Torch_DIR:[A-Z]*=//p' "$build/CMakeCache.txt")
[ -n "$torch_dir" ] && launcher+=(-DTorch_DIR="$torch_dir")

check() {  # name, build dir
  "$2/consumer" | tee "$work/$1.out"
  grep -q "consumer ok: world 1 value 2 file 2" "$work/$1.out"
  echo "package: $1 ok"
}

if [ "$part" = subdirectory ]; then
  # This compiles the whole library again; without optimization or debug
  # information (a build type with no flags of its own) it costs a third of
  # what the suite's own build does, and still proves that dtrain builds,
  # links and runs as a subproject.
  cmake -S "$consumer" -B "$work/subdir" "${launcher[@]}" -DDTRAIN_SOURCE_DIR="$src" \
    -DCMAKE_BUILD_TYPE=None >/dev/null
  cmake --build "$work/subdir" -j2 >/dev/null
  check subdirectory "$work/subdir"
  exit 0
fi
[ "$part" = find ] || { echo "package_test.sh: the third argument is find or subdirectory, not '$part'"; exit 2; }

cmake --install "$build" --prefix "$work/prefix" >/dev/null
mv "$work/prefix" "$work/moved-prefix"
test -f "$work/moved-prefix/include/dtrain/dtrain.h"
# Relative to the prefix: the build tree's own path may hold "src" (as in
# Debian unstable's root, /src/dtrain/build).
if [ -n "$(cd "$work/moved-prefix/include" && find . -path '*src*')" ]; then
  echo "private headers were installed"; exit 1
fi
cmake -S "$consumer" -B "$work/installed" "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$work/moved-prefix" >/dev/null
cmake --build "$work/installed" -j2 >/dev/null
check installed "$work/installed"

# The installed tools run from the moved prefix as they are: no
# LD_LIBRARY_PATH, their RUNPATH finds libdtrain relative to themselves.
(
  unset LD_LIBRARY_PATH
  cd "$work"
  for tool in dtrain-run dtrain-trace dtrain-bench dtrain-fashion-mnist collectives_demo dtrain-lighthouse \
      dtrain-ft-fashion-mnist; do
    test -x "moved-prefix/bin/$tool" || { echo "package: $tool was not installed"; exit 1; }
  done
  moved-prefix/bin/dtrain-run --standalone --nproc-per-node 2 moved-prefix/bin/collectives_demo \
    >"$work/demo.out" 2>&1 || { cat "$work/demo.out"; echo "package: installed dtrain-run failed"; exit 1; }
  cat "$work/demo.out"
  grep -q "rank 1/2: sent \[10, 11, 12, 13\] | all_reduce(SUM) -> \[10, 12, 14, 16\]" "$work/demo.out"
  moved-prefix/bin/dtrain-fashion-mnist --help >/dev/null
  usage=$(moved-prefix/bin/dtrain-trace 2>&1 || true)
  grep -q "usage: dtrain-trace analyze DIR" <<<"$usage" || { echo "package: dtrain-trace: $usage"; exit 1; }
)
echo "package: installed dtrain-run with an installed example ok"

# Fault tolerance as installed: the lighthouse on a free port, one replica
# of two ranks under the installed dtrain-run, sharing the job token (with
# none, --standalone would make the replica one the lighthouse lacks).
(
  unset LD_LIBRARY_PATH
  cd "$work"
  export DTRAIN_STORE_TOKEN=package-test-job-token
  moved-prefix/bin/dtrain-lighthouse --port 0 >"$work/lighthouse.out" 2>&1 &
  lighthouse=$!
  trap 'kill $lighthouse 2>/dev/null || true' EXIT
  for _ in $(seq 100); do grep -q "serving on" "$work/lighthouse.out" && break; sleep 0.1; done
  address=$(sed -n 's/^dtrain-lighthouse: serving on \([^ ]*\) .*/\1/p' "$work/lighthouse.out")
  [ -n "$address" ] || { cat "$work/lighthouse.out"; echo "package: the installed lighthouse did not start"; exit 1; }
  timeout 120 moved-prefix/bin/dtrain-run --standalone --nproc-per-node 2 moved-prefix/bin/dtrain-ft-fashion-mnist \
    --lighthouse "$address" --steps 5 --log-every 5 >"$work/ft.out" 2>&1 ||
    { cat "$work/ft.out"; echo "package: the installed fault-tolerant example failed"; exit 1; }
  grep -q "replica-0: done, 5 steps committed" "$work/ft.out" || { cat "$work/ft.out"; exit 1; }
)
echo "package: installed dtrain-lighthouse and a fault-tolerant replica ok"

# The nccl plug-in (when built) is found beside the moved libdtrain and
# loaded on demand. Without a GPU the group then says why it cannot run -
# which proves the plug-in loaded (a missing one says "could not be loaded").
if ls "$work"/moved-prefix/lib*/libdtrain_nccl.so >/dev/null 2>&1 && ! command -v nvidia-smi >/dev/null; then
  (
    unset LD_LIBRARY_PATH
    cd "$work"
    moved-prefix/bin/dtrain-run --standalone --nproc-per-node 1 \
      moved-prefix/bin/dtrain-fashion-mnist --backend nccl --epochs 1 >"$work/nccl.out" 2>&1 || true
    grep -q "nccl: no usable CUDA device: cudaGetDeviceCount: " "$work/nccl.out" ||
      { cat "$work/nccl.out"; echo "package: the installed nccl plug-in did not load"; exit 1; }
  )
  echo "package: the installed nccl plug-in loads from the moved prefix"
fi

cmake -S "$consumer" -B "$work/buildtree" "${launcher[@]}" -Ddtrain_DIR="$build" >/dev/null
cmake --build "$work/buildtree" -j2 >/dev/null
check buildtree "$work/buildtree"

# Refusals at configure time, with dtrain's message rather than ATen's
# #error or the linker's.
refused() {  # name, expected text, cmake arguments...
  local name=$1 expected=$2
  shift 2
  if cmake -S "$consumer" -B "$work/$name" "${launcher[@]}" -Ddtrain_DIR="$build" "$@" >"$work/$name.out" 2>&1; then
    cat "$work/$name.out"; echo "package: $name was configured"; exit 1
  fi
  # CMake wraps long messages: compare with the line breaks taken out.
  tr -s ' \n' ' ' <"$work/$name.out" >"$work/$name.flat"
  grep -qF -- "$expected" "$work/$name.flat" ||
    { cat "$work/$name.out"; echo "package: $name: no '$expected'"; exit 1; }
  echo "package: $name refused"
}
refused old-standard "it sets CMAKE_CXX_STANDARD 14, and libtorch" -DCMAKE_CXX_STANDARD=14
refused old-std-flag "it sets -std=c++14 in CMAKE_CXX_FLAGS, and libtorch" -DCMAKE_CXX_FLAGS=-std=c++14
# Another libtorch, found first: version 0.1, with the pre-C++11 string ABI.
mkdir -p "$work/other-torch"
printf '%s\n' 'set(TORCH_CXX_FLAGS "-D_GLIBCXX_USE_CXX11_ABI=0")' \
  'if(NOT TARGET torch)' '  add_library(torch INTERFACE IMPORTED)' 'endif()' \
  >"$work/other-torch/TorchConfig.cmake"
printf '%s\n' 'set(PACKAGE_VERSION 0.1)' 'set(PACKAGE_VERSION_COMPATIBLE TRUE)' \
  >"$work/other-torch/TorchConfigVersion.cmake"
refused other-torch "this project found libtorch 0.1 (_GLIBCXX_USE_CXX11_ABI=0) in" \
  -DTorch_DIR="$work/other-torch"
grep -qF "but dtrain was built with libtorch " "$work/other-torch.flat"
