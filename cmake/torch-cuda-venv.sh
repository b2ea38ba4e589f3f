#!/usr/bin/env bash
# Makes a Python virtual environment holding PyPI's torch wheel for Linux, a CUDA build whose
# LibTorch (shared libraries, headers, CMake files) fedshard's device path links against
# (examples/libtorch: train_torch_gpu, test_torch_gpu), and prints where it is, to configure
# with: its folder, for CMAKE_PREFIX_PATH (not Torch_DIR alone, which lets a system LibTorch's
# Caffe2 config be found first). Only the torch wheel is installed (--no-deps): the CUDA
# libraries it needs come from the installed CUDA toolkit at link time, or are left to the
# loader (FEDSHARD_TORCH_LINK_ONLY), so the environment is for building. To run on a GPU,
# install the wheel's dependencies too (FEDSHARD_TORCH_DEPS=1) or have the matching cuDNN,
# cuSPARSELt and NVSHMEM on the loader's path.
#
#   cmake/torch-cuda-venv.sh [DIR]     (default: $FEDSHARD_TORCH_VENV or /opt/fedshard/torch-cuda)
#   FEDSHARD_TORCH_PREFIX=$(cmake/torch-cuda-venv.sh) cmake --workflow --preset torch-cuda
#
# Safe to run again: an environment that already has the pinned torch is kept.
set -euo pipefail

version=2.15.0  # the torch the peer benchmarks and the LibTorch path were written against
venv="${1:-${FEDSHARD_TORCH_VENV:-/opt/fedshard/torch-cuda}}"
python=/usr/bin/python3

site() { "${venv}/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
have() {
  [[ -x "${venv}/bin/python" ]] || return 1
  local dist
  dist="$(site)/torch-${version}.dist-info"
  [[ -d "${dist}" && -f "$(site)/torch/share/cmake/Torch/TorchConfig.cmake" ]]
}

if have; then
  echo "torch-cuda-venv: ${venv} has torch ${version}" >&2
else
  echo "torch-cuda-venv: installing torch ${version} (the wheel only) into ${venv}" >&2
  "${python}" -m venv "${venv}"
  deps=(--no-deps)
  [[ "${FEDSHARD_TORCH_DEPS:-0}" == 1 ]] && deps=()
  "${venv}/bin/pip" install -q --disable-pip-version-check "${deps[@]}" "torch==${version}"
  have || { echo "torch-cuda-venv: torch ${version} did not install into ${venv}" >&2; exit 1; }
fi
if ! grep -q 'cuda' <<<"$(ls "$(site)/torch/lib")"; then
  echo "torch-cuda-venv: the torch wheel in ${venv} has no CUDA libraries" >&2
  exit 1
fi
echo "$(site)/torch"
