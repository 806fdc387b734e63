#!/usr/bin/env bash
# A/B of kernel builds, in separate processes on one machine: runs `python3 -m BENCH ARGS` with the working tree's
# csrc/ (B) and with the csrc files in $AB_DIR (A, e.g. the previous commit's), alternating B A B A ... ($ROUNDS
# rounds, default 2), so machine drift shows as a difference between rounds, not between builds. More than two
# builds: AB_DIRS="name:dir name:dir ..." (each dir holds csrc files that replace the tree's; the tree itself is not
# run unless listed, e.g. as `tree:csrc`), run in that order every round.
# Prebuild every build's libraries into .jitcache first (the cache key is the csrc contents; see docs/wip/README.md).
# Usage: AB_DIR=ab/A bash scripts/ab_bench.sh bench.query --heads 32 ...   Logs: $OUT/ab-{B,A}N.log.
#        AB_DIRS="head:.jitcache/v-head new:.jitcache/v-new" GREP='^ +[0-9]+ +[0-9]+ ' bash scripts/ab_bench.sh
#            bench.topk --world 1 --no-merge --no-indexer --local --quick   (GREP: print only matching log lines)
#        AB_DIR=ab/A bash scripts/ab_bench.sh scripts/diag/select_phases.py --ctas 8   (a script: no --out)
#        then `python3 scripts/ab_local_table.py $OUT` for the local-selection logs side by side
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" /tmp/ab_b
cp csrc/* /tmp/ab_b/
if [ -n "${AB_DIRS:-}" ]; then
  read -r -a builds <<<"$AB_DIRS"
else
  builds=("B:/tmp/ab_b" "A:${AB_DIR:?set AB_DIR (or AB_DIRS) to the other build\'s csrc files}")
fi
bench=$1; shift
for r in $(seq 1 "${ROUNDS:-2}"); do
  for b in "${builds[@]}"; do
    side=${b%%:*} dir=${b#*:}
    cp /tmp/ab_b/* csrc/
    [ "$dir" = csrc ] || cp "$dir"/* csrc/
    if [[ "$bench" == *.py ]]; then run=(python3 "$bench"); else run=(python3 -m "$bench" --out "$OUT/ab-$side$r"); fi
    timeout "${STAGE_TIMEOUT:-150}" "${run[@]}" "$@" >"$OUT/ab-$side$r.log" 2>&1
    echo "== $side$r rc=$?"
  done
done
cp /tmp/ab_b/* csrc/
rm -rf "$OUT"/ab-*/
for f in "$OUT"/ab-*.log; do
  echo "##### $f"
  if [ -n "${GREP:-}" ]; then grep -E "$GREP" "$f"; else tail -n "${TAIL:-12}" "$f"; fi
done
