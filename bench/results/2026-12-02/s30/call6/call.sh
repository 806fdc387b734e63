#!/usr/bin/env bash
# session 30, call 6: bucket_top with each thread placing its own keys (a key alone in its bucket stored at its
# bucket's start at once, the others ranked inside their bucket after the scatter, no bucket recomputed per
# position): the local-selection GPU tests on the variant, then tree vs variant A/B at every shape, unforced and
# forced (4 + 64 tokens)
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/abf
cp csrc/topk_select.cu /tmp/sel_tree.cu
cp .jitcache/v-own/topk_select.cu csrc/
timeout 200 python3 -m pytest -q -x tests/test_topk_local_gpu.py -p no:cacheprovider > $OUT/test_own.txt 2>&1
echo "== variant tests rc=$?: $(tail -1 $OUT/test_own.txt)"
cp /tmp/sel_tree.cu csrc/topk_select.cu
B="tree:csrc own:.jitcache/v-own"
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
OUT=$OUT/ab ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A > $OUT/ab.txt 2>&1
OUT=$OUT/abf ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A --local-force 4,64 > $OUT/abf.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
python3 scripts/ab_local_table.py $OUT/abf > $OUT/abf_table.txt 2>&1
echo "== A/B unforced"; cat $OUT/ab_table.txt
echo "== A/B forced 4,64"; cat $OUT/abf_table.txt
tar czf $OUT/logs.tgz -C $OUT ab abf 2>/dev/null; rm -rf $OUT/ab $OUT/abf
