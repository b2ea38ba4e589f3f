#!/usr/bin/env bash
# fedshard's Gloo link (bench_link) against torch.distributed's Gloo (torch_gloo_allreduce.py):
# all_reduce(sum) of f32 between 2 processes on the loopback, 1, 16 and 64 MiB.
#
# Every round runs, per size, bench_link for four settings (unchecked pipelined, checked
# pipelined, unchecked one stage, unchecked pipelined over 4 stripes: 16 and 64 MiB only) and
# then the torch peer, each in fresh processes and
# interleaved, so that load from elsewhere hits both sides alike. The table gives each
# case's median over the rounds. Progress goes to stderr, the table to stdout.
#
# Usage: bench/peer/link.sh [--bench PATH] [--venv DIR] [--rounds N]
#   --bench   bench_link binary  (env FEDSHARD_BENCH_LINK, default <repo>/build/release/bench/bench_link)
#   --venv    Python venv with torch (env FEDSHARD_PEER_VENV, default /opt/peer-venv;
#             bench/peer/setup_venv.sh makes it)
#   --rounds  rounds (env ROUNDS, default 3)
# Benchmark-only: CI never runs this, and the library never depends on the venv.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
bench=${FEDSHARD_BENCH_LINK:-$root/build/release/bench/bench_link}
venv=${FEDSHARD_PEER_VENV:-/opt/peer-venv}
rounds=${ROUNDS:-3}
while (($#)); do
  case $1 in
    --bench) bench=$2; shift 2 ;;
    --venv) venv=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    *) echo "link.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
py=$venv/bin/python

[[ -x "$bench" ]] || { echo "link.sh: bench_link not found at $bench (build the Release benches, or pass --bench)" >&2; exit 1; }
"$py" -c 'import torch' 2>/dev/null ||
  { echo "link.sh: no torch in venv $venv (run bench/peer/setup_venv.sh, or pass --venv)" >&2; exit 1; }

results=$(mktemp)  # one line per measurement: MiB case Gbit/s
trap 'rm -f "$results"' EXIT

# bench_link case -> the Gbit/s counter of its single benchmark (fails on a skipped/errored one).
fedshard() {  # MiB checked pipelined stripes
  "$bench" --benchmark_filter="^bm_all_reduce/MiB:$1/checked:$2/pipelined:$3/stripes:$4/" \
      --benchmark_format=json |
    "$py" -c 'import json, sys; (b,) = json.load(sys.stdin)["benchmarks"]; print(b["Gbit/s"])' ||
    { echo "link.sh: bench_link failed for MiB:$1/checked:$2/pipelined:$3/stripes:$4" >&2; return 1; }
}

# torch peer -> "mean median": Gbit_s_mean is bench_link's own formula (bytes x 8 x calls /
# total time), Gbit_s the median call's.
torch_gloo() {  # MiB
  "$py" "$here/torch_gloo_allreduce.py" "$1" |
    "$py" -c 'import json, sys; d = json.load(sys.stdin); print(d["Gbit_s_mean"], d["Gbit_s"])' ||
    { echo "link.sh: torch_gloo_allreduce.py failed for $1 MiB" >&2; return 1; }
}

for ((r = 1; r <= rounds; r++)); do
  for mib in 1 16 64; do
    echo "link.sh: round $r/$rounds, $mib MiB" >&2
    # Plain assignments, so that set -e stops the script when a run fails.
    up=$(fedshard "$mib" 0 1 1)
    cp=$(fedshard "$mib" 1 1 1)
    one=$(fedshard "$mib" 0 0 1)
    striped=nan
    if ((mib > 1)); then striped=$(fedshard "$mib" 0 1 4); fi
    torch=$(torch_gloo "$mib")
    read -r torch_mean torch_median <<<"$torch"
    printf '%s %s %s\n' "$mib" unchecked_pipelined "$up" "$mib" checked_pipelined "$cp" \
      "$mib" unchecked_one_stage "$one" "$mib" four_stripes "$striped" "$mib" torch "$torch_mean" \
      "$mib" torch_median_call "$torch_median" >>"$results"
  done
done

# Median over rounds of every case, as a markdown table.
"$py" - "$results" "$rounds" <<'PY'
import collections, statistics, sys
v = collections.defaultdict(list)
for line in open(sys.argv[1]):
    mib, case, gbit = line.split()
    v[int(mib), case].append(float(gbit))
m = {k: statistics.median(x) for k, x in v.items()}
print(f"all_reduce(sum) f32, 2 processes, loopback; Gbit/s = bytes x 8 / time, "
      f"median of {sys.argv[2]} rounds")
print()
print("| size | fedshard unchecked pipelined | fedshard checked pipelined | fedshard one stage "
      "| fedshard 4 stripes | torch gloo | fedshard/torch | torch gloo (median call) |")
print("|---|---|---|---|---|---|---|---|")
for mib in sorted({k[0] for k in m}):
    c = lambda case: m[mib, case]
    print(f"| {mib} MiB | {c('unchecked_pipelined'):.2f} | {c('checked_pipelined'):.2f} "
          f"| {c('unchecked_one_stage'):.2f} | {c('four_stripes'):.2f} | {c('torch'):.2f} "
          f"| {c('unchecked_pipelined') / c('torch'):.2f} | {c('torch_median_call'):.2f} |")
PY
