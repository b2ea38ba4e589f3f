#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU, CUDA (nvcc) and cmake: builds fedshard's CUDA
# targets in Release for the GPUs present, runs the GPU tests (ctest -L gpu),
# bench_kernels_cuda and bench_train_cuda, and writes everything into OUTDIR (default
# bench/results):
#
#   OUTDIR/device.txt               nvidia-smi's view of the machine (if nvidia-smi exists)
#   OUTDIR/configure.log, build.log
#   OUTDIR/gpu_tests.log            ctest -L gpu --output-on-failure
#   OUTDIR/bench_kernels_cuda.json  Google Benchmark JSON (console output: .log next to it)
#   OUTDIR/bench_train_cuda.json    the same for the training rows
#   OUTDIR/summary.txt              the tables printed at the end, the check that every
#                                   copy-like row reaches vs_memcpy >= 0.85 at 64 MiB, and
#                                   the check that every training row reaches
#                                   overlap_efficiency >= 0.9
#
# Usage: bench/gpu_check.sh [OUTDIR]
# Environment: FEDSHARD_GPU_BUILD_DIR (default build/gpu-check), JOBS (default nproc),
# FEDSHARD_GPU_BUILD_ONLY=1 (configure and build, then stop: no GPU needed, e.g. to build on
# a machine without one and run elsewhere), FEDSHARD_GPU_PREBUILT=1 (skip configure and
# build: run the executables already in FEDSHARD_GPU_BUILD_DIR, test_cuda_* at its top and
# bench/bench_*_cuda, each test directly, not through ctest, so the folder may have been built
# on another machine at another path), FEDSHARD_GPU_TEST_TIMEOUT (seconds per test, 600),
# FEDSHARD_GPU_BENCH_TIMEOUT (seconds per benchmark executable, 1800),
# CUDA_ARCHS (default native), CMAKE_ARGS (extra configure arguments, split on spaces),
# BENCH_ARGS (extra bench_kernels_cuda arguments, e.g. --benchmark_filter=weighted),
# TRAIN_BENCH_ARGS (extra bench_train_cuda arguments, e.g. --benchmark_filter=fsdp; the
# model's sizes come from the FEDSHARD_TRAIN_* variables, see bench/README.md).
# Needs the doctest and Google Benchmark development files (cmake/install-deps.sh).
# Exits non-zero if anything fails, if there is no GPU, if a GPU test was skipped, if a
# copy-like row misses vs_memcpy >= 0.85 at 64 MiB, or if a training row misses
# overlap_efficiency >= 0.9.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-"$root/bench/results"}
mkdir -p "$out"
out=$(cd "$out" && pwd)
build=${FEDSHARD_GPU_BUILD_DIR:-"$root/build/gpu-check"}
jobs=${JOBS:-$(nproc 2>/dev/null || echo 4)}
archs=${CUDA_ARCHS:-native}
start=$(date +%s)

say() { printf 'gpu_check: %s\n' "$*"; }
fail() {
  printf 'gpu_check: FAILED: %s\n' "$*" >&2
  exit 1
}

if [[ -z "${CUDACXX:-}" ]] && ! command -v nvcc >/dev/null 2>&1; then
  [[ -x /usr/local/cuda/bin/nvcc ]] || fail "no nvcc (set CUDACXX or put the CUDA toolkit on PATH)"
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi >"$out/device.txt" 2>&1 || true
  nvidia-smi -L 2>/dev/null | sed 's/^/gpu_check: device: /' || true
  if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    fail "nvidia-smi lists no GPU (see $out/device.txt)"
  fi
else
  say "nvidia-smi not found; the GPU tests will tell whether a device is usable"
  # "native" needs a GPU at configure time; build for sm_80 and sm_90 instead.
  [[ -n "${CUDA_ARCHS:-}" ]] || archs="80;90"
fi

prebuilt=${FEDSHARD_GPU_PREBUILT:-0}
build_only=${FEDSHARD_GPU_BUILD_ONLY:-0}
test_timeout=${FEDSHARD_GPU_TEST_TIMEOUT:-600}
bench_timeout=${FEDSHARD_GPU_BENCH_TIMEOUT:-1800}
if ((prebuilt)); then
  say "using the executables already built in $build (FEDSHARD_GPU_PREBUILT=1)"
  for exe in "$build/bench/bench_kernels_cuda" "$build/bench/bench_train_cuda"; do
    [[ -x "$exe" ]] || fail "FEDSHARD_GPU_PREBUILT=1 but $exe is missing"
  done
  compgen -G "$build/test_cuda_*" >/dev/null || fail "FEDSHARD_GPU_PREBUILT=1 but $build has no test_cuda_*"
else
say "configuring $build (Release, CUDA architectures: $archs)"
# shellcheck disable=SC2086  # CMAKE_ARGS is a list of arguments
cmake -S "$root" -B "$build" \
  -DCMAKE_BUILD_TYPE=Release \
  -DFEDSHARD_ENABLE_CUDA=ON \
  -DFEDSHARD_BUILD_TESTS=ON \
  -DFEDSHARD_BUILD_BENCH=ON \
  -DFEDSHARD_BUILD_EXAMPLES=OFF \
  -DFEDSHARD_VERIFY_HEADERS=OFF \
  -DCMAKE_CUDA_ARCHITECTURES="$archs" \
  ${CMAKE_ARGS:-} >"$out/configure.log" 2>&1 || {
  tail -n 30 "$out/configure.log" >&2
  fail "configure (log: $out/configure.log)"
}

say "building the GPU tests, bench_kernels_cuda and bench_train_cuda with $jobs jobs"
cmake --build "$build" -j "$jobs" --target fedshard_gpu_tests bench_kernels_cuda bench_train_cuda \
  >"$out/build.log" 2>&1 || {
  grep -E 'error|Error' "$out/build.log" | head -n 30 >&2 || true
  fail "build (log: $out/build.log)"
}
fi
if ((build_only)); then
  say "built in $build ($(($(date +%s) - start)) s); FEDSHARD_GPU_BUILD_ONLY=1: not running"
  exit 0
fi

# Runs every test_cuda_* executable of the build folder directly, with a timeout each, and
# reports like ctest (exit status 77: skipped, as SKIP_RETURN_CODE). Prints each test's own
# output after its line when it did not pass.
run_tests_directly() {
  local n=0 passed=0 failed=0 t name rc began log
  local tests=("$build"/test_cuda_*)
  for t in "${tests[@]}"; do
    [[ -x "$t" && ! -d "$t" ]] || continue
    n=$((n + 1))
    name=$(basename "$t")
    log=$(mktemp)
    began=$(date +%s.%N)
    rc=0
    timeout "$test_timeout" "$t" >"$log" 2>&1 || rc=$?
    local secs
    secs=$(awk -v a="$began" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
    if ((rc == 0)); then
      passed=$((passed + 1))
      printf 'Test #%d: %s ... Passed %s sec\n' "$n" "$name" "$secs"
      grep -E '^\[doctest\] (test cases|assertions):' "$log" | sed 's/^/    /' || true
    elif ((rc == 77)); then
      printf 'Test #%d: %s ... Skipped %s sec\n' "$n" "$name" "$secs"
      cat "$log"
    else
      failed=$((failed + 1))
      printf 'Test #%d: %s ... Failed (exit %d%s) %s sec\n' "$n" "$name" "$rc" \
        "$( ((rc == 124)) && echo ", timed out after $test_timeout s")" "$secs"
      cat "$log"
    fi
    rm -f "$log"
  done
  printf '%d%% tests passed, %d tests failed out of %d\n' \
    "$((n ? 100 * passed / n : 0))" "$failed" "$n"
  ((n > 0 && failed == 0))
}

tests_ok=1
if ((prebuilt)); then
  say "running the test_cuda_* executables"
  run_tests_directly >"$out/gpu_tests.log" 2>&1 || tests_ok=0
else
  say "running ctest -L gpu"
  ctest --test-dir "$build" -L gpu --output-on-failure --timeout "$test_timeout" \
    >"$out/gpu_tests.log" 2>&1 || tests_ok=0
fi
grep -E 'tests passed|Test +#|Skipped|Failed' "$out/gpu_tests.log" | sed 's/^/gpu_check:   /' || true
if grep -q 'Skipped' "$out/gpu_tests.log"; then
  tests_ok=0
  say "GPU tests were skipped: no usable CUDA device"
fi

say "running bench_kernels_cuda"
bench_ok=1
# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
timeout "$bench_timeout" "$build/bench/bench_kernels_cuda" \
  --benchmark_out="$out/bench_kernels_cuda.json" --benchmark_out_format=json \
  ${BENCH_ARGS:-} >"$out/bench_kernels_cuda.log" 2>&1 || bench_ok=0

say "running bench_train_cuda"
train_ok=1
# shellcheck disable=SC2086  # TRAIN_BENCH_ARGS is a list of arguments
timeout "$bench_timeout" "$build/bench/bench_train_cuda" \
  --benchmark_out="$out/bench_train_cuda.json" --benchmark_out_format=json \
  ${TRAIN_BENCH_ARGS:-} >"$out/bench_train_cuda.log" 2>&1 || train_ok=0

summarize() {
  python3 - "$out/bench_kernels_cuda.json" <<'EOF'
import json, sys
try:
    runs = json.load(open(sys.argv[1]))["benchmarks"]
except json.JSONDecodeError as e:
    print(f"{sys.argv[1]} is not complete JSON ({e}): was bench_kernels_cuda stopped? "
          "Its console log beside it has the rows it finished")
    sys.exit(1)
print(f"{'benchmark':52} {'GB/s':>9} {'memcpy GB/s':>12} {'vs_memcpy':>9} {'overhead':>9}")
for r in runs:
    if r.get("run_type") == "aggregate":
        continue
    gbps = r.get("GBps", r.get("bytes_per_second", 0) / 1e9)
    mem = r.get("memcpy_GBps")
    ratio = r.get("vs_memcpy", r.get("ratio_vs_memcpy"))
    over = r.get("overhead")
    print(f"{r['name']:52} {gbps:9.1f} "
          f"{'' if mem is None else f'{mem:.1f}':>12} "
          f"{'' if ratio is None else f'{ratio:.3f}':>9} "
          f"{'' if over is None else f'{100 * over:+.2f}%':>9}")
print("targets: vs_memcpy >= 0.85 for the copy-like rows at 64 MiB (checked below) and at "
      "256 MiB; NCCL overhead <= 2% at >= 64 MiB")
# The check: every copy-like row (memcpy, casts, pack/unpack, weighted sums, optimizer steps,
# cuda_space, gpu_inproc) at 64 MiB must reach vs_memcpy >= 0.85.
checked = ("memcpy/", "cast/", "pack/", "unpack/", "weighted_sum/", "adamw/", "outer_",
           "cuda_space/", "gpu_inproc/")
missed = [r for r in runs
          if r.get("run_type") != "aggregate" and "vs_memcpy" in r
          and r["name"].startswith(checked) and "/67108864" in r["name"]
          and r["vs_memcpy"] < 0.85]
for r in missed:
    print(f"below target: {r['name']} vs_memcpy {r['vs_memcpy']:.3f} < 0.85")
print(f"vs_memcpy >= 0.85 at 64 MiB: {'OK' if not missed else f'{len(missed)} rows missed'}")
sys.exit(1 if missed else 0)
EOF
}
# The training rows: tokens/s, step times and overlap efficiency; every row must have run and
# reach overlap_efficiency >= 0.9.
summarize_train() {
  python3 - "$out/bench_train_cuda.json" <<'EOF'
import json, sys
try:
    runs = [r for r in json.load(open(sys.argv[1]))["benchmarks"]
            if r.get("run_type") != "aggregate"]
except json.JSONDecodeError as e:
    print(f"FAIL: {sys.argv[1]} is not complete JSON ({e}): was bench_train_cuda stopped?")
    sys.exit(1)
print(f"{'benchmark':28} {'tokens/s':>12} {'step ms':>9} {'ref ms':>8} {'overlap':>8} "
      f"{'comm MB':>8}")
failed = []
for r in runs:
    name = r["name"].split("/iterations:")[0]  # drop Google Benchmark's suffixes
    if r.get("error_occurred"):
        print(f"{name:28} error: {r.get('error_message', '')}")
        failed.append(f"FAIL: {name} did not run: {r.get('error_message', '')}")
        continue
    eff = r.get("overlap_efficiency", 0.0)
    print(f"{name:28} {r.get('tokens_per_s', 0):12.0f} {r.get('step_ms', 0):9.3f} "
          f"{r.get('ref_step_ms', 0):8.3f} {eff:8.3f} {r.get('comm_MB_per_step', 0):8.1f}"
          f"{'  < 0.9' if eff < 0.9 else ''}")
    if eff < 0.9:
        failed.append(f"FAIL: {name} overlap_efficiency {eff:.3f} < 0.9")
if not runs:
    failed.append("FAIL: bench_train_cuda reported no rows")
print("overlap_efficiency = ranks x t_1 / t_R, t_1 = one rank alone measured in the same row "
      "(tokens = samples); target >= 0.9")
for line in failed:
    print(line)
print(f"overlap_efficiency >= 0.9: {'OK' if not failed else f'{len(failed)} rows failed'}")
sys.exit(1 if failed else 0)
EOF
}
targets_ok=1
if [[ -s "$out/bench_kernels_cuda.json" ]] && command -v python3 >/dev/null 2>&1; then
  summarize >"$out/summary.txt" || targets_ok=0
  cat "$out/summary.txt"
else
  tail -n 40 "$out/bench_kernels_cuda.log" | tee "$out/summary.txt"
fi
train_targets_ok=1
if [[ -s "$out/bench_train_cuda.json" ]] && command -v python3 >/dev/null 2>&1; then
  summarize_train >"$out/summary_train.txt" || train_targets_ok=0
  tee -a "$out/summary.txt" <"$out/summary_train.txt"
  rm -f "$out/summary_train.txt"
else
  tail -n 40 "$out/bench_train_cuda.log" | tee -a "$out/summary.txt"
  train_targets_ok=0
fi

say "results in $out ($(($(date +%s) - start)) s)"
((tests_ok)) || fail "GPU tests (log: $out/gpu_tests.log)"
((bench_ok)) || fail "bench_kernels_cuda (log: $out/bench_kernels_cuda.log)"
((targets_ok)) || fail "bandwidth targets: vs_memcpy < 0.85 at 64 MiB (see $out/summary.txt)"
((train_ok)) || fail "bench_train_cuda (log: $out/bench_train_cuda.log)"
((train_targets_ok)) || fail "training rows: overlap_efficiency < 0.9 (see $out/summary.txt)"
say "OK"
