#!/usr/bin/env bash
# fedshard's ddp and fsdp against torch's DDP and FSDP2 (fully_shard) over gloo, on one model,
# data and optimizer (bench/peer/peer_data_parallel.cpp and torch_data_parallel.py: 4 x
# Linear(1024, 1024), batch 64 per rank, MSE, SGD, one thread per rank), both on the same
# LibTorch: the peer venv's (PyPI's torch wheel), fedshard's side built against it in --build
# as bench/peer/overhead.sh does.
#
# Every round runs, per algorithm, fedshard's program and then torch's, each a fresh set of
# processes, interleaved so that load from elsewhere hits both alike; each prints the median
# of its timed steps (rank 0, after a barrier) and writes rank 0's parameters after the last
# step. Each round checks the two parameter files are equal byte for byte (the run fails
# otherwise) and the table gives the medians over rounds and fedshard/torch. Progress goes
# to stderr, the table to stdout.
#
# Usage: bench/peer/data_parallel.sh [--venv DIR] [--build DIR] [--rounds N] [--ranks N]
#                                    [--steps S] [--warmup W]
#   --venv    Python venv with torch (env FEDSHARD_PEER_VENV, default /opt/peer-venv)
#   --build   build folder (env FEDSHARD_PEER_BUILD, default <repo>/build/peer)
#   --rounds  rounds (env ROUNDS, default 3); --ranks 2, --steps 30, --warmup 5 by default
# Benchmark-only: CI never runs this, and the library never depends on the venv.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${FEDSHARD_PEER_VENV:-/opt/peer-venv}
build=${FEDSHARD_PEER_BUILD:-$root/build/peer}
rounds=${ROUNDS:-3}
ranks=2
steps=30
warmup=5
while (($#)); do
  case $1 in
    --venv) venv=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    *) echo "data_parallel.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
for v in rounds ranks steps; do
  [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "data_parallel.sh: --$v takes a positive integer, found '${!v}'" >&2; exit 2; }
done
[[ $warmup =~ ^[0-9]+$ ]] || { echo "data_parallel.sh: --warmup takes an integer >= 0, found '$warmup'" >&2; exit 2; }

py=$venv/bin/python
source "$here/torch_build.sh"  # torch_dir, version, torch_build
torch_build peer_data_parallel
exe=$build/bench/peer_data_parallel

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
step_ms() { grep -oE '^step_ms [0-9.]+' | cut -d' ' -f2; }
for ((r = 1; r <= rounds; ++r)); do
  for algo in ddp fsdp; do
    echo "data_parallel.sh: round $r of $rounds, $algo" >&2
    f=$("$exe" --algo "$algo" --ranks "$ranks" --steps "$steps" --warmup "$warmup" \
      --out "$work/fedshard.bin" | step_ms)
    t=$("$py" "$here/torch_data_parallel.py" --algo "$algo" --ranks "$ranks" --steps "$steps" \
      --warmup "$warmup" --out "$work/torch.bin" | step_ms)
    [[ -n $f && -n $t ]] || { echo "data_parallel.sh: a side printed no step_ms" >&2; exit 1; }
    if ! cmp -s "$work/fedshard.bin" "$work/torch.bin"; then
      echo "data_parallel.sh: $algo: fedshard's parameters differ from torch's after $((warmup + steps)) steps" >&2
      exit 1
    fi
    echo "$algo $f $t" >>"$work/results"
  done
done

median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
echo "torch $version (PyPI), $ranks ranks of one thread, $((warmup + steps)) steps ($steps timed), $rounds rounds; parameters equal bit for bit in every round"
echo "| algorithm | fedshard step (ms) | torch step (ms) | fedshard/torch |"
echo "|---|---:|---:|---:|"
for algo in ddp fsdp; do
  f=$(awk -v a="$algo" '$1 == a {print $2}' "$work/results" | median)
  t=$(awk -v a="$algo" '$1 == a {print $3}' "$work/results" | median)
  peer=$([[ $algo == ddp ]] && echo "DDP" || echo "FSDP2")
  printf '| %s vs %s | %.2f | %.2f | %.2f |\n' "$algo" "$peer" "$f" "$t" "$(awk -v f="$f" -v t="$t" 'BEGIN {print f / t}')"
done
