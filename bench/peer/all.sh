#!/usr/bin/env bash
# Every peer comparison of bench/peer/ in one run, one after another, each interleaving its
# own sides in fresh processes (see each script's header): the one-rank tax (overhead.sh),
# ddp and fsdp against torch DDP and FSDP2 (data_parallel.sh), fl_fsdp and diloco against
# torchft's LocalSGD and DiLoCo over the Gloo and elastic links, with SGD inside (parameters
# checked equal bit for bit) and with AdamW inside, and the inner step alone with AdamW
# (local_sgd.sh with K past the run: no sync among the timed steps but fedshard's last one).
# Prints every table; fails when one of them fails.
#
# Usage: bench/peer/all.sh [--rounds N]    (default 3; also for overhead.sh's runs)
# Benchmark-only: CI never runs this, and the library never depends on the peer venv
# (bench/peer/setup_venv.sh makes it).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
rounds=${ROUNDS:-3}
while (($#)); do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    *) echo "all.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "all.sh: --rounds takes a positive integer, found '$rounds'" >&2; exit 2; }

echo "## One rank: fedshard against plain LibTorch (AdamW)"
"$here/overhead.sh" --rounds "$rounds"
echo
echo "## Data parallel on 2 ranks (SGD)"
"$here/data_parallel.sh" --rounds "$rounds"
for algo in localsgd diloco; do
  for optim in sgd adamw; do
    echo
    echo "## 2 groups, $algo, $optim inside, K = 20"
    "$here/local_sgd.sh" --rounds "$rounds" --algo "$algo" --optim "$optim"
  done
done
echo
echo "## The inner step alone (AdamW; K = 1000: no sync among the timed steps but fedshard's last)"
"$here/local_sgd.sh" --rounds "$rounds" --algo localsgd --optim adamw --k 1000 --warmup 5 --steps 40
