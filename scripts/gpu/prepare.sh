#!/usr/bin/env bash
# On the development machine, from the project's root, before using the GPU
# machine (the device tool): fills .gpu/ (git-ignored) with what that machine
# lacks - Debian's CLI11, OpenSSL headers and library, the Fashion-MNIST
# package, the Python baselines - and the build script. Then, there,
# carrying .gpu: `bash scripts/gpu/run.sh build gpu+suite bench cpu16` (each
# stage under its own time limit; docs/compatibility.md says what they
# measure).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu/debs .gpu/baselines
cp scripts/gpu/build.sh .gpu/
baselines=${DTRAIN_BASELINES:-../shared/baselines}
cp "$baselines"/*.py .gpu/baselines/ 2>/dev/null || echo "prepare: no baselines in $baselines (set DTRAIN_BASELINES)"
pkgs="libcli11-dev nlohmann-json3-dev dataset-fashion-mnist libssl-dev libssl3"
(cd .gpu/debs && apt-get download $pkgs >/dev/null 2>&1) ||
  { apt-get update -qq && (cd .gpu/debs && apt-get download $pkgs >/dev/null); }
du -sh .gpu
