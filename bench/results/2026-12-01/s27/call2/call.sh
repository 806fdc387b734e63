#!/usr/bin/env bash
# session 27, call 2: where the publish's ~2 us go (diagnosis builds: no release / no read-back; one
# GPU, local stores), then the Top-K, Query and Output suites (ranks sharing the GPU) on the tree with one
# launch_config helper for the PDL launches (host code; device PTX unchanged)
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/pf
OUT=$OUT/pf ROUNDS=2 AB_DIRS="tree:csrc norel:.jitcache/v-norel noread:.jitcache/v-noread" GREP='^ *[24] +16384' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh scripts/diag/publish_fused.py /tmp/pf --worlds 2 4 --rows 1 8 128 --lengths 16384 > $OUT/pf.txt 2>&1
PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "tests-query:tests/test_query_gpu.py" "tests-output:tests/test_output_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
tar czf $OUT/logs.tgz -C $OUT pf 2>/dev/null; rm -rf $OUT/pf
echo "== publish diag"; cat $OUT/pf.txt
echo "== check"; sed -n '/-------- summary/,$p' $OUT/check.txt
