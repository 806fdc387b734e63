#!/usr/bin/env bash
# A/B of two kernel builds, in separate processes on one machine: runs `python3 -m BENCH ARGS` with the working
# tree's csrc/ (B) and with the csrc files in $AB_DIR (A, e.g. the previous commit's), alternating B A B A ...
# ($ROUNDS pairs, default 2), so machine drift shows as a difference between rounds, not between builds.
# Prebuild both libraries into .jitcache first (the cache key is the csrc contents; see docs/wip/README.md).
# Usage: AB_DIR=ab/A bash scripts/ab_bench.sh bench.query --heads 32 ...   Logs: $OUT/ab-{B,A}N.log.
#        AB_DIR=ab/A bash scripts/ab_bench.sh scripts/diag/select_phases.py --ctas 8   (a script: no --out)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" /tmp/ab_b
A=${AB_DIR:?set AB_DIR to the A build\'s csrc files}
cp csrc/* /tmp/ab_b/
bench=$1; shift
for r in $(seq 1 "${ROUNDS:-2}"); do
  for side in B A; do
    if [ "$side" = A ]; then cp "$A"/* csrc/; else cp /tmp/ab_b/* csrc/; fi
    if [[ "$bench" == *.py ]]; then run=(python3 "$bench"); else run=(python3 -m "$bench" --out "$OUT/ab-$side$r"); fi
    timeout "${STAGE_TIMEOUT:-150}" "${run[@]}" "$@" >"$OUT/ab-$side$r.log" 2>&1
    echo "== $side$r rc=$?"
  done
done
cp /tmp/ab_b/* csrc/
rm -rf "$OUT"/ab-*/
for f in "$OUT"/ab-*.log; do echo "##### $f"; tail -n "${TAIL:-12}" "$f"; done
