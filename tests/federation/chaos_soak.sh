#!/bin/sh
# The chaos test's long form (tests/federation/test_chaos_gloo.cpp): 3 group processes of an
# elastic federation, KILLS random SIGKILLs (phase of a round, victim, rank and restart delay
# drawn from SEED), each victim restarted; fails when a live group exits or hangs, a restart
# does not heal, or the groups' models differ after any round. Prints the worst stall per
# phase. About 1 s per kill on 2 cores.
#
# Usage, from a build dir with the Gloo tests built
# (cmake --build . --target test_federation_chaos_gloo):
#   ../../tests/federation/chaos_soak.sh [KILLS [SEED [KEEP_DIR]]]
#   e.g. cd build/dev && ../../tests/federation/chaos_soak.sh 100 7
# KILLS defaults to 100, SEED to 1; with KEEP_DIR the run's files (parameters per round,
# step times, link and trainer logs, the store) are kept under it for a post-mortem.
# FEDSHARD_CHAOS_ALGORITHM=diloco in the environment soaks diloco (heals from two donors).
set -eu
kills=${1:-100}
seed=${2:-1}
keep=${3:-}
case "$kills$seed" in
  *[!0-9]*) echo "chaos_soak.sh: KILLS and SEED must be whole numbers, found '$kills' '$seed'" >&2; exit 2 ;;
esac
if [ "$kills" -lt 1 ]; then echo "chaos_soak.sh: KILLS must be >= 1, found $kills" >&2; exit 2; fi
bin=tests/test_federation_chaos_gloo
if [ ! -x "$bin" ]; then
  echo "chaos_soak.sh: $bin not found: run this from a build dir where the Gloo tests are built" >&2
  exit 2
fi
FEDSHARD_CHAOS_KILLS=$kills FEDSHARD_CHAOS_SEED=$seed FEDSHARD_CHAOS_DIR=$keep \
  exec "$bin" --test-case='chaos: the long soak*'
