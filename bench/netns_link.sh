#!/usr/bin/env bash
# bench_link across a real link: two network namespaces joined by a veth pair, with a rate
# limit and (where the kernel has the netem qdisc) added latency on each direction, so that
# one TCP connection's window meets a real bandwidth-delay product and stripes can add
# windows. The two ranks of every benchmark run one in each namespace
# (FEDSHARD_BENCH_NETNS, see bench/bench_link.cpp).
#
# Needs root (ip netns, ip link, tc). Without netem the link gets the rate limit alone (tbf),
# and the script says so: then one connection fills the link and stripes cannot add to it.
# Without namespaces or veth pairs it stops with the reason, having changed nothing.
# Whatever it set up is removed when it exits.
#
# Usage: bench/netns_link.sh [--bench PATH] [--rate RATE] [--delay MS] [--filter REGEX]
#   --bench   bench_link binary (env FEDSHARD_BENCH_LINK, default
#             <repo>/build/release/bench/bench_link)
#   --rate    the link's rate each way, as tc writes it (default 1gbit)
#   --delay   one-way delay in ms added by netem (default 20; 0: none)
#   --filter  which rows of bench_link (default: all_reduce and transfers of 16/64 MiB over
#             1, 2 and 4 stripes)
# Benchmark-only: CI never runs this.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
bench=${FEDSHARD_BENCH_LINK:-$root/build/release/bench/bench_link}
rate=1gbit
delay=20
filter='bm_all_reduce/MiB:(16|64)/checked:0/pipelined:1/stripes:[124]/|bm_transfer/MiB:64/'
while (($#)); do
  case $1 in
    --bench) bench=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --delay) delay=$2; shift 2 ;;
    --filter) filter=$2; shift 2 ;;
    *) echo "netns_link.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
[[ -x "$bench" ]] || { echo "netns_link.sh: bench_link not found at $bench (build the Release benches, or pass --bench)" >&2; exit 1; }
[[ "$delay" =~ ^[0-9]+$ ]] || { echo "netns_link.sh: --delay takes whole ms, found '$delay'" >&2; exit 2; }
[[ $(id -u) == 0 ]] || { echo "netns_link.sh: needs root (ip netns, tc)" >&2; exit 1; }

ns0=fedshard_link0 ns1=fedshard_link1
addr0=10.77.0.1 addr1=10.77.0.2
cleanup() {
  ip netns del "$ns0" 2>/dev/null || true  # deleting a namespace deletes its veth end and pair
  ip netns del "$ns1" 2>/dev/null || true
}
trap cleanup EXIT
cleanup

ip netns add "$ns0" || { echo "netns_link.sh: this machine refuses network namespaces" >&2; exit 1; }
ip netns add "$ns1"
ip link add fsl0 netns "$ns0" type veth peer name fsl1 netns "$ns1" ||
  { echo "netns_link.sh: this machine refuses veth pairs" >&2; exit 1; }
for i in 0 1; do
  ns=ns$i addr=addr$i
  ip -n "${!ns}" addr add "${!addr}/24" dev "fsl$i"
  ip -n "${!ns}" link set lo up
  ip -n "${!ns}" link set "fsl$i" up
done

# The qdisc on each end's egress: netem (delay and rate) where the kernel has it, else tbf.
shaped="rate $rate, no added delay"
for i in 0 1; do
  ns=ns$i
  if ((delay > 0)) && tc -n "${!ns}" qdisc add dev "fsl$i" root netem delay "${delay}ms" rate "$rate" limit 100000 2>/dev/null; then
    shaped="rate $rate, ${delay} ms each way (netem): RTT $((2 * delay)) ms"
  else
    if ((delay > 0)) && [[ $i == 0 ]]; then
      echo "netns_link.sh: no netem qdisc on this kernel ($(tc -n "${!ns}" qdisc add dev "fsl$i" root netem delay 1ms 2>&1 | head -n 1)); the link gets the rate limit alone (tbf), without latency" >&2
    fi
    tc -n "${!ns}" qdisc add dev "fsl$i" root tbf rate "$rate" burst 256kb latency 100ms
  fi
done
echo "netns_link.sh: $ns0 ($addr0) <-> $ns1 ($addr1) over a veth pair: $shaped" >&2
for i in 0 1; do
  ns=ns$i
  ip -n "${!ns}" link show "fsl$i" | grep -q LOWER_UP ||
    { echo "netns_link.sh: the veth end fsl$i in ${!ns} is not up" >&2; exit 1; }
done

FEDSHARD_BENCH_NETNS="$ns0@$addr0,$ns1@$addr1" "$bench" --benchmark_filter="$filter" \
  --benchmark_counters_tabular=true
