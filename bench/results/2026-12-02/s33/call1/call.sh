#!/usr/bin/env bash
# session 33, call 1 (one GPU): the memory + Top-K GPU suites with ranks sharing the GPU (W = 2) and the main job on
# the tree (0f562aa's race fix, first GPU run); select_dist by distribution for tree / radix (a crowded middle
# threshold sends the row to the radix select at once) / loop (sample_thresholds re-buckets crowded samples by their
# bits in a second round of the same code); A/B of the three on normal, indexer (bench.topk's mended _local_scores)
# and forced (4 + 64) scores
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/abi $OUT/abf $OUT/sd
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=250 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_memory_gpu.py tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
grep -E "^== |passed|failed|verdict|PASS|FAIL" $OUT/check.txt | tail -8
three="tree:csrc radix:.jitcache/v-radix loop:.jitcache/v-loop"
OUT=$OUT/sd ROUNDS=1 AB_DIRS="$three" GREP='^\|' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh scripts/diag/select_dist.py --rows 1 128 --lengths 2048 4096 16384 65536 131072 > $OUT/select_dist.txt 2>&1
cat $OUT/select_dist.txt
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
for m in ab: abi:--local-scores=indexer abf:--local-force=4,64; do
  d=${m%%:*} x=${m#*:}
  OUT=$OUT/$d ROUNDS=2 AB_DIRS="$three" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A ${x/=/ } > $OUT/$d.txt 2>&1
  python3 scripts/ab_local_table.py $OUT/$d > $OUT/${d}_table.txt 2>&1
  echo "== A/B $d"; cat $OUT/${d}_table.txt
done
tar czf $OUT/logs.tgz -C $OUT ab abi abf sd chk 2>/dev/null; rm -rf $OUT/ab $OUT/abi $OUT/abf $OUT/sd $OUT/chk
