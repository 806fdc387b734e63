#!/usr/bin/env bash
# A/B of two whole trees on one machine (a Python-side change: a move, a refactor), in separate processes: each
# benchmark runs in this tree (B) and in $AB_TREE (A, another checkout with its own prebuilt .jitcache), alternating
# B A B A ... ($ROUNDS rounds, default 2), so machine drift shows as a difference between rounds, not between trees.
# Each argument is one benchmark: "module args..." (split on spaces). Logs: $OUT/ab-<n>-{B,A}<round>.log.
# Make A with: mkdir ab && git archive REV | tar -x -C ab && PEERDCP_CACHE=$PWD/ab/.jitcache python -m <REV's jit module>
# Usage: AB_TREE=ab bash scripts/ab_tree.sh "bench.output --quick" "bench.query --quick" "bench.topk --quick"
set -uo pipefail
cd "$(dirname "$0")/.."
tree_b=$PWD
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}
tree_a=$(cd "${AB_TREE:?set AB_TREE to the other tree}" && pwd)
mkdir -p "$OUT"
n=0
for spec in "$@"; do
  n=$((n + 1))
  read -r -a words <<<"$spec"
  for r in $(seq 1 "${ROUNDS:-2}"); do
    for side in B A; do
      if [ "$side" = B ]; then dir=$tree_b; else dir=$tree_a; fi
      log="$OUT/ab-$n-$side$r.log"
      (cd "$dir" && PYTHONPATH="$dir" PEERDCP_CACHE="$dir/.jitcache" timeout "${STAGE_TIMEOUT:-150}" \
        python3 -m "${words[@]}" --out "$OUT/ab-$n-$side$r" >"$log" 2>&1)
      echo "== ${words[0]} $side$r rc=$?"
    done
  done
done
rm -rf "$OUT"/ab-*/
for f in "$OUT"/ab-*.log; do
  echo "##### $f"
  tail -n "${TAIL:-14}" "$f"
done
