#!/usr/bin/env bash
# session 31, call 3: the tree = call 2's `scan` build (the one-barrier block scan; the bucket ids beside the keys
# dropped): the memory + Top-K GPU suites with ranks sharing the GPU (W = 2) and the main job, the select_ctas rule's
# sweep after the kernel change, and head / tree A/B with forced tokens (4 + 64)
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/abf
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=250 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_memory_gpu.py tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
grep -E "^== |passed|failed|verdict|PASS|FAIL" $OUT/check.txt | tail -8
timeout 90 python3 scripts/diag/select_ctas_sweep.py > $OUT/ctas_sweep.txt 2>&1; echo "== select_ctas sweep rc=$?"; cat $OUT/ctas_sweep.txt | tail -25
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
OUT=$OUT/abf ROUNDS=2 AB_DIRS="head:.jitcache/v-head tree:csrc" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A --local-force 4,64 > $OUT/abf.txt 2>&1
python3 scripts/ab_local_table.py $OUT/abf > $OUT/abf_table.txt 2>&1
echo "== A/B forced 4,64"; cat $OUT/abf_table.txt
tar czf $OUT/logs.tgz -C $OUT abf chk 2>/dev/null; rm -rf $OUT/abf $OUT/chk
