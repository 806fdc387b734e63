#!/usr/bin/env bash
# session 32, call 1: the tree = bucket_top with kMaxBucket 128 and a second map by the keys' bits before the
# fallback (+ scan_pairs, the two-bin scan shared with scan_bins): the memory + Top-K GPU suites with ranks sharing
# the GPU (W = 2) and the main job; select_dist (time by score distribution) for head / k128 (kMaxBucket 128 alone) /
# tree; head / tree A/B on normal scores
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/sd
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=250 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_memory_gpu.py tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
grep -E "^== |passed|failed|verdict|PASS|FAIL" $OUT/check.txt | tail -8
OUT=$OUT/sd ROUNDS=1 AB_DIRS="head:.jitcache/v-head k128:.jitcache/v-k128 tree:csrc" STAGE_TIMEOUT=100 TAIL=20 bash scripts/ab_bench.sh scripts/diag/select_dist.py --rows 1 128 > $OUT/select_dist.txt 2>&1
cat $OUT/select_dist.txt
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
OUT=$OUT/ab ROUNDS=2 AB_DIRS="head:.jitcache/v-head tree:csrc" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A > $OUT/ab.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
echo "== A/B normal"; cat $OUT/ab_table.txt
tar czf $OUT/logs.tgz -C $OUT ab sd chk 2>/dev/null; rm -rf $OUT/ab $OUT/sd $OUT/chk
