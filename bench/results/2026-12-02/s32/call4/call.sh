#!/usr/bin/env bash
# session 32, call 4: the tree = B: the estimate's map by bits run only where the first gather misses the window and
# the samples crowded (estimate_by_bits called from the walk); A = call 3's tree (run right after the estimate
# wherever crowded). The memory + Top-K GPU suites on B (ranks sharing the GPU, W = 2) and the main job; A/B prev
# (5848641) / A / B on normal scores and with forced tokens (4 + 64); select_dist on B
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/abf
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=250 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_memory_gpu.py tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
grep -E "^== |passed|failed|verdict|PASS|FAIL" $OUT/check.txt | tail -8
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
for c in "ab:" "abf:--local-force 4,64"; do
  d=${c%%:*}; extra=${c#*:}
  OUT=$OUT/$d ROUNDS=2 AB_DIRS="prev:.jitcache/v-prev a:.jitcache/v-a b:csrc" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A $extra > $OUT/$d.txt 2>&1
  python3 scripts/ab_local_table.py $OUT/$d > $OUT/${d}_table.txt 2>&1
done
timeout 100 python3 scripts/diag/select_dist.py --rows 1 128 --lengths 2048 4096 16384 65536 131072 > $OUT/select_dist.txt 2>&1; echo "== select_dist (B) rc=$?"; tail -12 $OUT/select_dist.txt
echo "== A/B normal"; cat $OUT/ab_table.txt; echo "== A/B forced 4,64"; cat $OUT/abf_table.txt
tar czf $OUT/logs.tgz -C $OUT ab abf chk ab.txt abf.txt 2>/dev/null; rm -rf $OUT/ab $OUT/abf $OUT/chk $OUT/ab.txt $OUT/abf.txt
