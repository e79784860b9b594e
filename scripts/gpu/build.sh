#!/usr/bin/env bash
# On the GPU machine, from the project's root (after scripts/gpu/prepare.sh
# here, carrying .gpu): unpacks the carried packages into /opt/deps and
# builds dtrain against the PyTorch in python3 into /tmp/b (Release, ninja,
# every core). Extra arguments go to CMake. Logs go to $OUT when it is set.
set -u
log=${OUT:-/tmp}
TD=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')
D=/opt/deps/usr
[ -d $D ] || { mkdir -p /opt/deps && for f in .gpu/debs/*.deb; do dpkg -x "$f" /opt/deps; done; }
mkdir -p /usr/share/datasets && ln -sfn $D/share/datasets/fashion-mnist /usr/share/datasets/fashion-mnist
t0=$(date +%s)
cmake -S . -B /tmp/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TD/share/cmake;$D" \
  -DOPENSSL_ROOT_DIR=$D -DCMAKE_CXX_FLAGS="-isystem $D/include -isystem $D/include/x86_64-linux-gnu" \
  -DCMAKE_INSTALL_PREFIX=/tmp/p "$@" > "$log/configure.log" 2>&1 \
  || { tail -30 "$log/configure.log"; exit 1; }
cmake --build /tmp/b -j"$(nproc)" > "$log/build.log" 2>&1 || { grep -E "error" -A3 "$log/build.log" | head -60; exit 1; }
echo "built against torch $(python3 -c 'import torch; print(torch.__version__)') in /tmp/b in $(( $(date +%s) - t0 )) s"
