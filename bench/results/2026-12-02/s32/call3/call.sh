#!/usr/bin/env bash
# session 32, call 3: the tree = call 2's bucket_top + the estimate's second map (sample_thresholds by the samples'
# bits where the middle threshold's bucket is crowded: estimate_by_bits, out of line): the memory + Top-K GPU
# suites with ranks sharing the GPU (W = 2) and the main job; select_dist for prev (the commit 5848641) / tree; A/B
# prev / tree on normal and indexer scores and with forced tokens (4 + 64)
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/abi $OUT/abf $OUT/sd
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=250 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_memory_gpu.py tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
grep -E "^== |passed|failed|verdict|PASS|FAIL" $OUT/check.txt | tail -8
two="prev:.jitcache/v-prev tree:csrc"
OUT=$OUT/sd ROUNDS=1 AB_DIRS="$two" STAGE_TIMEOUT=100 TAIL=12 bash scripts/ab_bench.sh scripts/diag/select_dist.py --rows 1 128 --lengths 2048 4096 16384 65536 131072 > $OUT/select_dist.txt 2>&1
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
for c in "ab:" "abi:--local-scores indexer" "abf:--local-force 4,64"; do
  d=${c%%:*}; extra=${c#*:}
  OUT=$OUT/$d ROUNDS=2 AB_DIRS="$two" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A $extra > $OUT/$d.txt 2>&1
  python3 scripts/ab_local_table.py $OUT/$d > $OUT/${d}_table.txt 2>&1
done
cat $OUT/select_dist.txt | grep -v "^== "
echo "== A/B normal"; cat $OUT/ab_table.txt; echo "== A/B indexer"; cat $OUT/abi_table.txt; echo "== A/B forced 4,64"; cat $OUT/abf_table.txt
tar czf $OUT/logs.tgz -C $OUT ab abi abf sd chk ab.txt abi.txt abf.txt 2>/dev/null; rm -rf $OUT/ab $OUT/abi $OUT/abf $OUT/sd $OUT/chk $OUT/ab.txt $OUT/abi.txt $OUT/abf.txt
