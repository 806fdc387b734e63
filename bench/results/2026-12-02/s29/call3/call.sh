#!/usr/bin/env bash
# session 29, call 3: the final tree (store_taken lambda + division-free kernel start + the "auto" PDL rule for
# TopK.select's merge): Top-K GPU suites and the main job with ranks sharing the GPU (W = 2); head (ee243ee) vs
# tree A/B of the local selection at every shape, with and without forced tokens
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/abf $OUT/chk
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
B="head:.jitcache/v-head tree:csrc"
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
OUT=$OUT/ab ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A > $OUT/ab.txt 2>&1
OUT=$OUT/abf ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A --local-force 4,64 > $OUT/abf.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
python3 scripts/ab_local_table.py $OUT/abf > $OUT/abf_table.txt 2>&1
gzip -9 $OUT/chk/tests-topk.log; cp $OUT/chk/tests-topk.log.gz $OUT/chk/run.json $OUT/ 2>/dev/null
tar czf $OUT/logs.tgz -C $OUT ab abf chk 2>/dev/null; rm -rf $OUT/ab $OUT/abf $OUT/chk
echo "== A/B unforced"; cat $OUT/ab_table.txt
echo "== A/B forced 4,64"; cat $OUT/abf_table.txt
echo "== check"; grep -E "passed|failed|error|PASS|FAIL" $OUT/check.txt | tail -8; tail -6 $OUT/check.txt
