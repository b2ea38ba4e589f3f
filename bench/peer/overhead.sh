#!/usr/bin/env bash
# The one-rank tax against the peer's own LibTorch: bench_overhead (a plain LibTorch step of
# 4 x Linear(1024, 1024), batch 64, AdamW, one thread, against fedshard's ddp, fsdp and
# fl_hsdp steps of the same model on one rank) built against the torch of the peer venv
# (PyPI's wheel: its LibTorch, with the CMake files it ships) instead of Debian's libtorch.
#
# Configures a Release build of the benchmarks alone in --build (tests, examples, MPI, Gloo and
# CUDA off), builds bench_overhead and runs BM_side_by_side --rounds times, each a fresh
# process. The table gives each ratio's median per run (the benchmark's own medians of
# per-round ratios) and the median over runs. Progress goes to stderr, the table to stdout.
#
# Usage: bench/peer/overhead.sh [--venv DIR] [--build DIR] [--rounds N] [--min-time S]
#   --venv      Python venv with torch (env FEDSHARD_PEER_VENV, default /opt/peer-venv;
#               bench/peer/setup_venv.sh makes it)
#   --build     build folder (env FEDSHARD_PEER_BUILD, default <repo>/build/peer)
#   --rounds    runs (env ROUNDS, default 3)
#   --min-time  seconds each run measures for (default 40, the benchmark's own)
# Benchmark-only: CI never runs this, and the library never depends on the venv.
# How it builds against the wheel: bench/peer/torch_build.sh.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${FEDSHARD_PEER_VENV:-/opt/peer-venv}
build=${FEDSHARD_PEER_BUILD:-$root/build/peer}
rounds=${ROUNDS:-3}
min_time=40
while (($#)); do
  case $1 in
    --venv) venv=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --min-time) min_time=$2; shift 2 ;;
    *) echo "overhead.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "overhead.sh: --rounds takes a positive integer, found '$rounds'" >&2; exit 2; }
[[ $min_time =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "overhead.sh: --min-time takes seconds, found '$min_time'" >&2; exit 2; }

py=$venv/bin/python
source "$here/torch_build.sh"  # torch_dir, version, torch_build
torch_build bench_overhead
exe=$build/bench/bench_overhead

keys="ddp/plain fsdp/plain fl_hsdp/fsdp plain_ms ddp_ms"
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for ((r = 1; r <= rounds; ++r)); do
  echo "overhead.sh: run $r of $rounds" >&2
  line=$("$exe" --benchmark_filter=BM_side_by_side --benchmark_min_time="$min_time" 2>&1 |
    grep '^BM_side_by_side') || { echo "overhead.sh: bench_overhead printed no result" >&2; exit 1; }
  for k in $keys; do
    v=$(grep -oE "(^| )$k=[0-9.e+-]+" <<<"$line" | cut -d= -f2)
    [[ -n $v ]] || { echo "overhead.sh: no counter $k in: $line" >&2; exit 1; }
    echo "$r $k $v" >>"$results"
  done
done

median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
echo "torch $version (PyPI), one thread, $rounds runs of $min_time s"
printf '| %s |' "run"
for k in $keys; do printf ' %s |' "$k"; done
printf '\n|---|'
for _ in $keys; do printf -- '---:|'; done
printf '\n'
for ((r = 1; r <= rounds; ++r)); do
  printf '| %s |' "$r"
  for k in $keys; do printf ' %.3f |' "$(awk -v r="$r" -v k="$k" '$1 == r && $2 == k {print $3}' "$results")"; done
  printf '\n'
done
printf '| median |'
for k in $keys; do printf ' %.3f |' "$(awk -v k="$k" '$2 == k {print $3}' "$results" | median)"; done
printf '\n'
