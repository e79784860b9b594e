#!/usr/bin/env bash
# On the development machine, from the project's root, before using the GPU
# machine (the device tool): fills .gpu/ (git-ignored) with what that machine
# lacks - Debian's CLI11, OpenSSL headers and library, the Fashion-MNIST
# package, the Python baselines - and the scripts to run there. Then, there,
# carrying .gpu: `bash .gpu/part-b.sh tests` and `bash .gpu/part-b.sh bench`
# (each under 10 minutes; see docs/compatibility.md for what they measure).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu/debs .gpu/baselines
cp scripts/gpu/build.sh scripts/gpu/part-b.sh .gpu/
baselines=${DTRAIN_BASELINES:-../shared/baselines}
cp "$baselines"/*.py .gpu/baselines/ 2>/dev/null || echo "prepare: no baselines in $baselines (set DTRAIN_BASELINES)"
pkgs="libcli11-dev nlohmann-json3-dev dataset-fashion-mnist libssl-dev libssl3"
(cd .gpu/debs && apt-get download $pkgs >/dev/null 2>&1) ||
  { apt-get update -qq && (cd .gpu/debs && apt-get download $pkgs >/dev/null); }
du -sh .gpu
