#!/usr/bin/env bash
# session 28, call 1: the whole-key gather path (forced tokens; rows of <= 4096 scores) stores a sparse warp-step's
# keys one round per key of the busiest lane, a dense one by a block per position (hyb); the fast path's slot
# from one ballot when no lane took two keys (tree = hyb + that). Builds: head (bc24ccf), hyb, tree.
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/abf
timeout 200 python3 -m pytest -q -x -m "cuda or multigpu" --timeout=150 -p no:cacheprovider tests/test_topk_local_gpu.py > $OUT/tests-local.txt 2>&1
tail -2 $OUT/tests-local.txt
B="head:.jitcache/v-head hyb:.jitcache/v-hyb tree:csrc"
OUT=$OUT/ab ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 > $OUT/ab.txt 2>&1
OUT=$OUT/abf ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-force 4,64 > $OUT/abf.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
python3 scripts/ab_local_table.py $OUT/abf > $OUT/abf_table.txt 2>&1
tar czf $OUT/logs.tgz -C $OUT ab abf 2>/dev/null; rm -rf $OUT/ab $OUT/abf
echo "== A/B unforced"; cat $OUT/ab_table.txt
echo "== A/B forced 4,64"; cat $OUT/abf_table.txt
echo "== local tests"; tail -2 $OUT/tests-local.txt
