#!/usr/bin/env bash
# fedshard's fl_fsdp (parameters averaged over the groups every K steps) over a fixed Gloo link
# and over an elastic link, against torchft's LocalSGD (its Manager, lighthouse and
# ProcessGroupGloo); with --algo diloco, fedshard's diloco against torchft's DiLoCo (outer
# Nesterov SGD, lr 0.7, momentum 0.9, on both sides); 2 groups of one process and one thread each on the loopback, one model,
# data and optimizer (bench/peer/peer_local_sgd.cpp and torchft_local_sgd.py: 4 x
# Linear(1024, 1024), batch 64, MSE, SGD), both on the peer venv's LibTorch (fedshard's side
# built against it as overhead.sh does).
#
# Every round runs the three in turn, each in fresh processes; each reports group 0's mean step
# over the timed steps (the syncs among them amortized) and writes group 0's parameters at the
# end. With SGD, each round checks the three parameter files are equal byte for byte (the run
# fails otherwise); with AdamW they are not compared: torch's AdamW rounds its bias
# corrections and update differently from fedshard's, and m / sqrt(v) turns last-bit
# differences of tiny gradients into differences of up to lr per step; the table gives the medians over rounds and fedshard/torchft. torchft runs with
# init_sync off: every group starts from the same seed, so no state is copied at the start
# (with it on, a group's first K steps are replaced by another's state). Progress goes to
# stderr, the table to stdout.
#
# Usage: bench/peer/local_sgd.sh [--venv DIR] [--build DIR] [--rounds N] [--optim sgd|adamw]
#                                [--algo localsgd|diloco] [--k K] [--steps S] [--warmup W]
#   --venv    Python venv with torch and torchft (env FEDSHARD_PEER_VENV, default /opt/peer-venv;
#             bench/peer/setup_venv.sh makes it)
#   --build   build folder (env FEDSHARD_PEER_BUILD, default <repo>/build/peer)
#   --rounds  rounds (env ROUNDS, default 3); --k 20, --steps 40 timed, --warmup 20 by default
#   --optim   the inner optimizer: sgd (lr 0.01, the default) or adamw (torch's defaults)
# Benchmark-only: CI never runs this, and the library never depends on the venv.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${FEDSHARD_PEER_VENV:-/opt/peer-venv}
build=${FEDSHARD_PEER_BUILD:-$root/build/peer}
rounds=${ROUNDS:-3}
k=20
steps=40
warmup=20
optim=sgd
algo=localsgd
while (($#)); do
  case $1 in
    --venv) venv=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --k) k=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --optim) optim=$2; shift 2 ;;
    --algo) algo=$2; shift 2 ;;
    *) echo "local_sgd.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
for v in rounds k steps; do
  [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "local_sgd.sh: --$v takes a positive integer, found '${!v}'" >&2; exit 2; }
done
[[ $algo == localsgd || $algo == diloco ]] || { echo "local_sgd.sh: --algo takes localsgd or diloco, found '$algo'" >&2; exit 2; }
[[ $optim == sgd || $optim == adamw ]] || { echo "local_sgd.sh: --optim takes sgd or adamw, found '$optim'" >&2; exit 2; }
[[ $warmup =~ ^[0-9]+$ ]] || { echo "local_sgd.sh: --warmup takes an integer >= 0, found '$warmup'" >&2; exit 2; }

py=$venv/bin/python
"$py" -c 'import torchft' 2>/dev/null ||
  { echo "local_sgd.sh: no torchft in venv $venv (run bench/peer/setup_venv.sh)" >&2; exit 1; }
source "$here/torch_build.sh"  # torch_dir, version, torch_build
torch_build peer_local_sgd
exe=$build/bench/peer_local_sgd
ft_version=$("$py" -c 'import importlib.metadata as m; print(m.version("torchft"))')

work=$(mktemp -d)
lighthouse_pid=
cleanup() {
  [[ -n $lighthouse_pid ]] && kill "$lighthouse_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$venv/bin/torchft_lighthouse" --min_replicas 2 --quorum_tick_ms 100 --join_timeout_ms 10000 \
  --bind "127.0.0.1:$port" >"$work/lighthouse.log" 2>&1 &
lighthouse_pid=$!

mine=$([[ $algo == diloco ]] && echo diloco || echo fl_fsdp)  # fedshard's name
theirs=$([[ $algo == diloco ]] && echo DiLoCo || echo LocalSGD)
common=(--steps "$steps" --k "$k" --warmup "$warmup" --optim "$optim")
step_ms() { grep -oE '^step_ms [0-9.]+' "$1" | cut -d' ' -f2; }
# run NAME CMD...: group 1 in the background, group 0 in the foreground (its output kept).
run() {
  local name=$1
  shift
  "$@" 1 >"$work/$name.1.log" 2>&1 &
  local other=$!
  "$@" 0 --out "$work/$name.bin" >"$work/$name.0.log" 2>&1 ||
    { echo "local_sgd.sh: $name failed:" >&2; tail -5 "$work/$name.0.log" >&2; exit 1; }
  wait "$other" || { echo "local_sgd.sh: $name's group 1 failed:" >&2; tail -5 "$work/$name.1.log" >&2; exit 1; }
  step_ms "$work/$name.0.log"
}
fedshard() {  # fedshard LINK GROUP [--out FILE]
  local link=$1 group=$2
  shift 2
  "$exe" --link "$link" --store "$work/store.$link.$r" --group "$group" --algo "$mine" \
    "${common[@]}" "$@"
}
torchft() {  # torchft GROUP [--out FILE]
  local group=$1
  shift
  "$py" "$here/torchft_local_sgd.py" --lighthouse "http://127.0.0.1:$port" --group "$group" \
    --algo "$algo" "${common[@]}" "$@"
}
for ((r = 1; r <= rounds; ++r)); do
  echo "local_sgd.sh: round $r of $rounds" >&2
  mkdir -p "$work/store.gloo.$r" "$work/store.elastic.$r"
  g=$(run gloo fedshard gloo)
  e=$(run elastic fedshard elastic)
  t=$(run torchft torchft)
  [[ -n $g && -n $e && -n $t ]] || { echo "local_sgd.sh: a side printed no step_ms" >&2; exit 1; }
  for name in gloo elastic; do
    [[ $optim == adamw ]] && break  # not compared: see the header
    cmp -s "$work/$name.bin" "$work/torchft.bin" ||
      { echo "local_sgd.sh: fedshard's parameters over the $name link differ from torchft's" >&2; exit 1; }
  done
  echo "$g $e $t" >>"$work/results"
done

median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
g=$(cut -d' ' -f1 "$work/results" | median)
e=$(cut -d' ' -f2 "$work/results" | median)
t=$(cut -d' ' -f3 "$work/results" | median)
echo "torch $version, torchft $ft_version (PyPI); 2 groups of one thread, $optim, K = $k, $steps timed steps after $warmup; $rounds rounds; $([[ $optim == sgd ]] && echo "parameters equal bit for bit in every round" || echo "parameters not compared (AdamW)")"
echo "| run | mean step (ms) | x torchft $theirs |"
echo "|---|---:|---:|"
printf '| fedshard %s, Gloo link | %.2f | %.2f |\n' "$mine" "$g" "$(awk -v a="$g" -v b="$t" 'BEGIN {print a / b}')"
printf '| fedshard %s, elastic link | %.2f | %.2f |\n' "$mine" "$e" "$(awk -v a="$e" -v b="$t" 'BEGIN {print a / b}')"
printf '| torchft %s | %.2f | 1.00 |\n' "$theirs" "$t"
