#!/usr/bin/env bash
# Configures a build folder: scripts/configure.sh DIR [cmake arguments...]
# (the scripts' one way to run CMake's configure step). Uses Ninja when it is
# installed (setup.sh installs it): Ninja starts a program's units while the
# library they link is still compiling, where make waits for the library, so
# both cores stay busy to the end. A folder that was configured with another
# generator is reset first (CMake refuses to switch; its objects are rebuilt,
# from ccache where it has them).
# RelWithDebInfo here is -O2 with line tables only (-g1): backtraces and
# sanitizer reports keep their files and lines, and every unit compiles in
# about two thirds of the time that full debug information (CMake's -g)
# takes (docs/design/build-and-ci.md). For variables in a debugger, pass
# -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g -DNDEBUG" after DIR.
set -euo pipefail
dir=${1:?usage: scripts/configure.sh DIR [cmake arguments...]}
shift
generator=()
if command -v ninja >/dev/null; then
  generator=(-G Ninja)
  cache=$dir/CMakeCache.txt
  if [ -f "$cache" ] && ! grep -qx 'CMAKE_GENERATOR:INTERNAL=Ninja' "$cache"; then
    echo "configure: $dir was configured for another generator; reconfiguring it for Ninja"
    rm -rf "$cache" "$dir/CMakeFiles"
  fi
fi
cmake -S . -B "$dir" "${generator[@]}" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" "$@" >/dev/null
