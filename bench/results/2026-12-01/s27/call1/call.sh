#!/usr/bin/env bash
# session 27, call 1: the Top-K suites on the tree (ranks sharing the GPU), then two A/Bs against HEAD (083e85e):
# WIDE sampling at clusters of 4 (128K rows) and the publish's epoch copied at the selection kernel's start
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=240 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
mkdir -p $OUT/wide $OUT/pf
OUT=$OUT/wide ROUNDS=2 AB_DIRS="head:.jitcache/v-head tree:csrc" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=150 bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick --local-rows 4,8,12,16,20,24,32 --local-lengths 131072 > $OUT/wide.txt 2>&1
OUT=$OUT/pf ROUNDS=2 AB_DIRS="head:.jitcache/v-head tree:csrc" GREP='^\|' STAGE_TIMEOUT=200 bash scripts/ab_bench.sh scripts/diag/publish_fused.py /tmp/pf --worlds 2 4 --rows 1 8 32 128 --lengths 16384 131072 > $OUT/pf.txt 2>&1
python3 scripts/ab_local_table.py $OUT/wide > $OUT/wide_table.txt 2>&1
tar czf $OUT/logs.tgz -C $OUT wide pf check.txt tests-topk.log run.log 2>/dev/null; rm -rf $OUT/wide $OUT/pf
echo "== publish_fused A/B"; cat $OUT/pf.txt
echo "== wide A/B"; cat $OUT/wide_table.txt
echo "== check"; tail -5 $OUT/check.txt; grep -E "PASS|FAIL" $OUT/run.log | tail -1
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests-topk.log | tail -5
