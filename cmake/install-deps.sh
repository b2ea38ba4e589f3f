#!/usr/bin/env bash
# Installs what fedshard's build, tests, benchmarks and plots need on Debian 12, and only
# what is missing. Run as root (or as a user with sudo). Safe to run again.
#
# Then makes the Python virtual environment of the safetensors cross-check test, at
# $FEDSHARD_VENV (default /opt/fedshard/venv), with PyPI's safetensors and numpy; skipped when
# that environment already imports both.
set -euo pipefail

packages=(
  cmake g++ make git        # build (cmake >= 3.25; g++ brings the sanitizer runtimes)
  doctest-dev               # unit tests
  libbenchmark-dev          # benchmarks
  libopenmpi-dev openmpi-bin  # MPI backend and the Open MPI baseline of the benchmarks
  libgloo-dev libhiredis-dev  # Gloo backend (cross-job federation over TCP) and its Redis store
  libssl-dev                # OpenSSL's libcrypto: HMAC-SHA256 of the signed store (comm/signed_store.hpp)
  redis-server              # the Redis store's tests and examples/multi_job (started on the loopback)
  python3 python3-matplotlib  # plots of the demo's curves and the simulator's sweeps
  nlohmann-json3-dev        # safetensors export and import (fedshard::safetensors)
  python3-venv              # the virtual environment of the safetensors cross-check (below)
  libtorch-dev              # examples/libtorch (skipped cleanly when absent)
  util-linux                # setarch: ThreadSanitizer tests run without ASLR
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((EUID == 0)); then
  sudo=()
elif command -v sudo >/dev/null 2>&1; then
  sudo=(sudo)
else
  sudo=()
  if ((${#missing[@]} != 0)); then
    echo "install-deps: missing ${missing[*]}; run this script as root to install them" >&2
    exit 1
  fi
fi

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages are present: ${packages[*]}"
else
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -q
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The safetensors cross-check's Python: Debian's python3 (not another one earlier on PATH) in
# a virtual environment of its own, with pinned versions from PyPI. Without root or sudo,
# FEDSHARD_VENV must name a folder this user can create. Nothing else needs it: when PyPI
# cannot be reached, this says so and goes on (the cross-check test then says it skipped;
# .ci/run refuses to go on without it).
venv="${FEDSHARD_VENV:-/opt/fedshard/venv}"
python_packages=(safetensors==0.8.0 numpy==2.4.6)
if "${venv}/bin/python" -c "import numpy, safetensors.numpy" >/dev/null 2>&1; then
  echo "install-deps: ${venv} has safetensors and numpy"
else
  echo "install-deps: making ${venv} with ${python_packages[*]}"
  if { [[ -x "${venv}/bin/python" ]] ||
       { "${sudo[@]}" mkdir -p "${venv}" && "${sudo[@]}" /usr/bin/python3 -m venv "${venv}"; }; } &&
     "${sudo[@]}" "${venv}/bin/python" -m pip install --quiet --disable-pip-version-check \
       "${python_packages[@]}" &&
     "${venv}/bin/python" -c "import numpy, safetensors.numpy"; then
    echo "install-deps: ${venv} has safetensors and numpy"
  else
    echo "install-deps: WARNING: could not make ${venv} with ${python_packages[*]} (is PyPI" \
         "reachable?); only the safetensors cross-check test needs it, and it will be skipped" >&2
  fi
fi
echo "install-deps: done"
