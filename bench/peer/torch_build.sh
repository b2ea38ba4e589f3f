# Sourced by bench/peer/overhead.sh and data_parallel.sh (after they set root, py and build):
# finds the LibTorch of the peer venv's torch (PyPI's wheel ships its shared libraries and
# CMake files) and defines torch_build TARGET..., which configures a Release build of the
# benchmarks alone in $build against it (tests, examples, MPI and CUDA off; Gloo on) and builds
# the targets, refusing a result that loads a system libc10 besides the venv's.
#
# Two things the wheel's CMake files need here: CMAKE_PREFIX_PATH is the torch folder (so its
# lib/ is searched), and c10_LIBRARY is given, since TorchConfig's find_library would take a
# system libc10 (Debian's libtorch-dev) first. The wheel is a CUDA build: its libtorch_cuda
# references NCCL symbols that the CUDA toolkit's older NCCL lacks, resolved at run time from
# the venv's own NCCL (libtorch's RUNPATH), so the link allows undefined symbols in shared
# libraries. No GPU is used.

torch_dir=$("$py" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null) ||
  { echo "$(basename "$0"): no torch in $py (run bench/peer/setup_venv.sh, or pass --venv)" >&2; exit 1; }
version=$("$py" -c 'import torch; print(torch.__version__)')
[[ -f $torch_dir/lib/libc10.so && -d $torch_dir/share/cmake/Torch ]] ||
  { echo "$(basename "$0"): $torch_dir has no LibTorch (lib/libc10.so, share/cmake/Torch)" >&2; exit 1; }

torch_build() {
  echo "$(basename "$0"): building $* in $build against torch $version ($torch_dir)" >&2
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_dir" \
    -Dc10_LIBRARY="$torch_dir/lib/libc10.so" -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined \
    -DFEDSHARD_BUILD_TESTS=OFF -DFEDSHARD_BUILD_EXAMPLES=OFF -DFEDSHARD_BUILD_BENCH=ON \
    -DFEDSHARD_ENABLE_MPI=OFF -DFEDSHARD_ENABLE_CUDA=OFF >/dev/null 2>&1 ||
    { echo "$(basename "$0"): configuring $build failed (run the cmake line of bench/peer/torch_build.sh to see why)" >&2; exit 1; }
  cmake --build "$build" --target "$@" -j 2 >/dev/null
  local t
  for t in "$@"; do
    if ldd "$build/bench/$t" | grep -q 'libc10\.so\.[0-9]'; then
      echo "$(basename "$0"): $build/bench/$t loads a system libc10 besides the venv's:" >&2
      ldd "$build/bench/$t" | grep libc10 >&2
      exit 1
    fi
  done
}
