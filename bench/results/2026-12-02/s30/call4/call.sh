#!/usr/bin/env bash
# session 30, call 4: TopK.select's eager host time (ranks sharing the GPU: host columns only), rows 1 and 8,
# with rank 0's cProfile
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
for T in 8 1; do
  PEERDCP_SHARED_GPU=1 timeout 200 python3 scripts/diag/topk_eager_profile.py --world 2 --rows $T --calls 300 > $OUT/eager$T.txt 2>&1
  echo "== rows $T rc=$?"; head -60 $OUT/eager$T.txt
done
