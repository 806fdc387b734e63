#!/usr/bin/env bash
# session 31, call 6: gather_all (rows of <= 4K local scores) takes each key's id from the first of its four
# (I == 1 or a multiple of 4), with two new test cases (I = 3 and I = 64 with forced windows): the memory + Top-K GPU
# suites with ranks sharing the GPU (W = 2) and the main job, then head (5c1998b) / tree A/B unforced and forced
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/abf
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_memory_gpu.py tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
grep -E "^== |passed|failed|verdict|PASS|FAIL" $OUT/check.txt | tail -8
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
B="head:.jitcache/v-head3 tree:csrc"
OUT=$OUT/ab ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A > $OUT/ab.txt 2>&1
OUT=$OUT/abf ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A --local-force 4,64 > $OUT/abf.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
python3 scripts/ab_local_table.py $OUT/abf > $OUT/abf_table.txt 2>&1
echo "== A/B unforced"; cat $OUT/ab_table.txt
echo "== A/B forced 4,64"; cat $OUT/abf_table.txt
tar czf $OUT/logs.tgz -C $OUT ab abf chk 2>/dev/null; rm -rf $OUT/ab $OUT/abf $OUT/chk
