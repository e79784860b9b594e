#!/usr/bin/env bash
# Installs the Debian packages dtrain needs for a purpose, only those that
# are missing. Used by the README's commands and by CI. Needs root (or sudo)
# the first time.
#   bash scripts/setup.sh main [packages...]   the library, dtrain-run and the
#                                              training example (scripts/train.sh)
#   bash scripts/setup.sh test [packages...]   main's, and what the test suite,
#                                              the benchmarks and the sanitizers use
#   bash scripts/setup.sh only packages...     just the named ones (compat.sh: mmdebstrap)
# Further arguments name packages a script needs besides (fuzz.sh: clang).
set -euo pipefail

purpose=${1:-test}
case "$purpose" in
  main|test|only) [ $# -gt 0 ] && shift ;;
  *) echo "setup.sh: unknown purpose '$purpose' (expected main, test or only)" >&2; exit 2 ;;
esac

main=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev      # libtorch (ATen, autograd, nn)
  zlib1g-dev        # gzip datasets
  libssl-dev        # libcrypto: HMAC-SHA256 for the store's job token
  dataset-fashion-mnist  # Fashion-MNIST IDX files (training example, data tests)
  libcli11-dev      # launcher and example flags
  nlohmann-json3-dev  # dtrain-run reads workers' error files; dtrain-trace, flight recorder dumps
  gnuplot-nox fonts-liberation  # the training example's PNG plot
)
test=(
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch     # PyTorch's torchrun and the Python baselines
  openmpi-bin libopenmpi-dev  # the mpi backend, and mpirun to test it
  iproute2          # network namespaces for the multi-host tests
  procps            # pgrep and sysctl: the Slurm and three-host tests
  slurm-wlm munge   # a real two-node Slurm for the srun tests
  fortunes          # dtrain-llama's corpus (examples/llama; scripts/llama.sh installs it alone)
)
# Installed where the release has them (Debian unstable), skipped elsewhere.
optional=(
  python3-safetensors  # Hugging Face's reader and writer, against dtrain's (safetensors_vs_python.sh)
)

packages=()
case "$purpose" in
  main) packages=("${main[@]}") ;;
  test)
    packages=("${main[@]}" "${test[@]}")
    for p in "${optional[@]}"; do
      if apt-cache show "$p" >/dev/null 2>&1; then packages+=("$p"); fi
    done
    ;;
esac
packages+=("$@")
missing=()
for p in "${packages[@]}"; do
  if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  start=$(date +%s)
  echo "setup: installing ${#missing[@]} packages and what they need: ${missing[*]}"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  # Another apt-get at work (a second script, unattended upgrades): wait for
  # it rather than fail.
  $sudo apt-get -o DPkg::Lock::Timeout=600 update -qq
  # A line every 25 packages set up, so a log shows that it moves.
  DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends \
    "${missing[@]}" | awk '/^Setting up/ { n++; if (n % 25 == 0) { printf("setup: %d packages set up\n", n); fflush() } }
                           END { printf("setup: %d packages set up\n", n) }'
  echo "setup: installed in $(( $(date +%s) - start )) s"
fi
