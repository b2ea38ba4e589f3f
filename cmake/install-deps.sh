#!/usr/bin/env bash
# Installs what fedshard's build, tests, benchmarks and plots need on Debian 12, and only
# what is missing. Run as root (or as a user with sudo). Safe to run again.
set -euo pipefail

packages=(
  cmake g++ make git        # build (cmake >= 3.25; g++ brings the sanitizer runtimes)
  doctest-dev               # unit tests
  libbenchmark-dev          # benchmarks
  libopenmpi-dev openmpi-bin  # MPI backend and the Open MPI baseline of the benchmarks
  libgloo-dev libhiredis-dev  # Gloo backend (cross-job federation over TCP) and its Redis store
  redis-server              # the Redis store's tests and examples/multi_job (started on the loopback)
  python3 python3-matplotlib  # plots of the demo's curves and the simulator's sweeps
  libtorch-dev              # examples/libtorch (skipped cleanly when absent)
  util-linux                # setarch: ThreadSanitizer tests run without ASLR
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages are present: ${packages[*]}"
  exit 0
fi

if ((EUID == 0)); then
  sudo=()
elif command -v sudo >/dev/null 2>&1; then
  sudo=(sudo)
else
  echo "install-deps: missing ${missing[*]}; run this script as root to install them" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -q
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "install-deps: done"
