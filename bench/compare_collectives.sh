#!/usr/bin/env bash
# Side-by-side algbw of inproc collectives (bench_collectives) and Open MPI's (raw MPI calls,
# bench_collectives_mpi under mpirun) at 2 and 4 ranks, 4 KiB to 64 MiB, plus the
# shared-memory-bound fraction of all_reduce: (p * t_memcpy(S)) / t_all_reduce.
#
# Usage: bench/compare_collectives.sh [--no-build]
#   FEDSHARD_BENCH_BUILD_DIR  build folder to use (with --no-build: where the binaries are)
#   MIN_TIME                  seconds per timed run (default 0.1)
#   ROUNDS                    rounds over all cases; each case reports its fastest round
#                             (default 3)
# The last line is exactly: all_reduce 4MiB 2 ranks inproc/mpi algbw ratio: X.XX
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
min_time=${MIN_TIME:-0.1}
rounds=${ROUNDS:-3}
build_dir=${FEDSHARD_BENCH_BUILD_DIR:-}
targets=(bench_collectives bench_collectives_mpi)
bench_opts=(-DFEDSHARD_BUILD_BENCH=ON -DFEDSHARD_ENABLE_MPI=ON)

if [[ "${1:-}" != "--no-build" ]]; then
  if [[ -z "$build_dir" ]] && cmake --list-presets 2>/dev/null | grep -q '"release"'; then
    configure_log=$(cmake --preset release "${bench_opts[@]}")
    build_dir=$(sed -n 's/^-- Build files have been written to: //p' <<<"$configure_log" | tail -n 1)
    cmake --build --preset release --target "${targets[@]}" -j 2 >/dev/null
  else
    build_dir=${build_dir:-build/release}
    cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release "${bench_opts[@]}" >/dev/null
    cmake --build "$build_dir" --target "${targets[@]}" -j 2 >/dev/null
  fi
fi
inproc_exe="$build_dir/bench/bench_collectives"
mpi_exe="$build_dir/bench/bench_collectives_mpi"
for exe in "$inproc_exe" "$mpi_exe"; do
  [[ -x "$exe" ]] || { echo "compare_collectives: expected $exe, not found" >&2; exit 1; }
done

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun_opts=(--oversubscribe --bind-to none)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Which Open MPI transport carries the traffic (one node: pml ob1 over the vader shared-memory btl).
transport_log=$(mpirun -np 2 "${mpirun_opts[@]}" --mca pml_base_verbose 10 --mca btl_base_verbose 10 \
  "$mpi_exe" --sizes=4096 --ops=all_reduce --min_time=0 --repetitions=1 2>&1 || true)
pml=$(grep -o 'selected [a-z0-9]* best priority' <<<"$transport_log" | head -n 1 | cut -d' ' -f2)
btl=$(grep -o 'Using [a-z0-9]* btl for send' <<<"$transport_log" | head -n 1 | cut -d' ' -f2)
echo "Open MPI $(mpirun --version | head -n 1 | grep -o '[0-9][0-9.]*$'): pml ${pml:-?}, btl ${btl:-?} (mpirun -np N ${mpirun_opts[*]})"

# Per round and op: inproc (2 and 4 ranks), then MPI at 2 and 4 ranks, back to back, so that
# load from elsewhere hits both sides alike; memcpy once per round.
run_inproc() {
  "$inproc_exe" --benchmark_filter="$1" --benchmark_min_time="$min_time" \
    --benchmark_out="$2" --benchmark_out_format=json >/dev/null 2>"$work/inproc.log" ||
    { cat "$work/inproc.log" >&2; exit 1; }
}
for ((r = 1; r <= rounds; ++r)); do
  echo "round $r/$rounds" >&2
  run_inproc '^bm_memcpy/' "$work/inproc_memcpy_$r.json"
  for op in all_reduce all_gather reduce_scatter broadcast; do
    run_inproc "^bm_inproc/$op/" "$work/inproc_${op}_$r.json"
    for np in 2 4; do
      mpirun -np "$np" "${mpirun_opts[@]}" "$mpi_exe" --ops="$op" --min_time="$min_time" \
        --repetitions=1 >"$work/mpi_${op}_${np}_$r.csv"
    done
  done
done

python3 - "$work" <<'PY'
import csv, glob, json, os, re, sys

work = sys.argv[1]
unit = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
inproc, mpi, memcpy = {}, {}, {}  # fastest seconds per call

def keep(table, key, t):
    table[key] = min(t, table.get(key, float("inf")))

for path in glob.glob(os.path.join(work, "inproc_*.json")):
    for b in json.load(open(path))["benchmarks"]:
        if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
            continue
        t = b["real_time"] * unit[b["time_unit"]]
        m = re.match(r"bm_inproc/(\w+)/bytes:(\d+)/ranks:(\d+)", b["name"])
        if m:
            keep(inproc, (m[1], int(m[2]), int(m[3])), t)
        m = re.match(r"bm_memcpy/bytes:(\d+)", b["name"])
        if m:
            keep(memcpy, int(m[1]), t)
for path in glob.glob(os.path.join(work, "mpi_*.csv")):
    for row in csv.DictReader(open(path)):
        keep(mpi, (row["op"], int(row["bytes"]), int(row["ranks"])), float(row["seconds_per_iter"]))

def size_name(b):
    for shift, suffix in ((20, "MiB"), (10, "KiB")):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift}{suffix}"
    return f"{b}B"

ops = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
rows, misses = [], []
# shm frac = p * t_memcpy(S) / t; pS frac = t_memcpy(p * S) / t (memcpy with the same working set)
print(f"{'op':<15}{'size':>7}{'ranks':>6}{'inproc GB/s':>13}{'mpi GB/s':>10}{'ratio':>8}{'shm frac':>10}{'pS frac':>9}")
for op in ops:
    for ranks in (2, 4):
        for size in sorted({k[1] for k in inproc} | {k[1] for k in mpi}):
            key = (op, size, ranks)
            ti, tm = inproc.get(key), mpi.get(key)
            if ti is None and tm is None:
                continue
            ai = size / ti / 1e9 if ti else float("nan")
            am = size / tm / 1e9 if tm else float("nan")
            ratio = ai / am if ti and tm else float("nan")
            frac, frac_ps = "-", "-"
            if op == "all_reduce" and ti and size in memcpy:
                f = ranks * memcpy[size] / ti
                frac = f"{f:.2f}"
                if size >= 1 << 20 and f < 0.6:
                    misses.append(f"{op} {size_name(size)} {ranks} ranks: shm fraction {f:.3f} < 0.60")
            if op == "all_reduce" and ti and ranks * size in memcpy:
                frac_ps = f"{memcpy[ranks * size] / ti:.2f}"
            if op == "all_reduce" and size >= 1 << 20 and not ratio >= 2.0:
                misses.append(f"{op} {size_name(size)} {ranks} ranks: inproc/mpi {ratio:.3f} < 2.00")
            print(f"{op:<15}{size_name(size):>7}{ranks:>6}{ai:>13.3f}{am:>10.3f}{ratio:>8.2f}{frac:>10}{frac_ps:>9}")
    print()
print("shm frac = p * t_memcpy(S) / t_all_reduce; pS frac = t_memcpy(p * S) / t_all_reduce")
print("memcpy GB/s (1 thread): " + ", ".join(f"{size_name(s)} {s / t / 1e9:.1f}" for s, t in sorted(memcpy.items())))
print("targets (all_reduce 1..64 MiB, 2 and 4 ranks: >= 2.00x MPI, shm fraction >= 0.60): "
      + ("all met" if not misses else f"{len(misses)} missed"))
for m in misses:
    print("  missed: " + m)
key = ("all_reduce", 4 << 20, 2)
r = size_name(4 << 20)
ratio = (mpi[key] / inproc[key]) if key in mpi and key in inproc else float("nan")
print(f"all_reduce {r} 2 ranks inproc/mpi algbw ratio: {ratio:.2f}")
PY
