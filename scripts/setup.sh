#!/usr/bin/env bash
# Installs the Debian packages dtrain needs, only those that are missing.
# Used by the README's commands and by CI. Needs root (or sudo) the first time.
# Arguments name further packages a script needs (fuzz.sh: clang).
set -euo pipefail

packages=(
  build-essential cmake ccache pkg-config
  libtorch-dev      # libtorch 1.13 (ATen, c10d headers)
  zlib1g-dev        # gzip datasets
  libssl-dev        # libcrypto: HMAC-SHA256 for the store's job token
  dataset-fashion-mnist  # Fashion-MNIST IDX files (training example, data tests)
  libcli11-dev      # launcher flags
  nlohmann-json3-dev  # dtrain-trace reads flight recorder dumps, dtrain-run workers' error files
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch     # PyTorch's torchrun and the Python baselines
  openmpi-bin libopenmpi-dev  # the mpi backend, and mpirun to test it
  iproute2          # network namespaces for the multi-host test
  procps            # pgrep and sysctl: the Slurm and three-host tests
  slurm-wlm munge   # a real two-node Slurm for the srun test
  gnuplot-nox fonts-liberation  # the training example's PNG plot
)

packages+=("$@")
missing=()
for p in "${packages[@]}"; do
  if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
