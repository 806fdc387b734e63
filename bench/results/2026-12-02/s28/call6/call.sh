#!/usr/bin/env bash
# session 28, call 6: bucket_top's key range from 32-bit warp reductions (redux.sync) and native 32-bit shared
# atomics over the score and id parts, instead of 64-bit shuffles and 64-bit shared atomic min / max (a CAS loop
# that 32 warps serialize); the samples' min / max by redux too. head (07e17e3) vs tree; local tests on the tree
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/abf
timeout 200 python3 -m pytest -q -x -m "cuda or multigpu" --timeout=150 -p no:cacheprovider tests/test_topk_local_gpu.py > $OUT/tests-local.txt 2>&1
tail -2 $OUT/tests-local.txt
B="head:.jitcache/v-head tree:csrc"
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
OUT=$OUT/ab ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A > $OUT/ab.txt 2>&1
OUT=$OUT/abf ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A --local-force 4,64 > $OUT/abf.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
python3 scripts/ab_local_table.py $OUT/abf > $OUT/abf_table.txt 2>&1
tar czf $OUT/logs.tgz -C $OUT ab abf 2>/dev/null; rm -rf $OUT/ab $OUT/abf
echo "== A/B unforced"; cat $OUT/ab_table.txt
echo "== A/B forced 4,64"; cat $OUT/abf_table.txt
echo "== local tests"; tail -2 $OUT/tests-local.txt
