#!/usr/bin/env bash
# session 36, call 2 (one GPU): the GPU suites after the set-up agreement (Output / Query / TopK constructors, the
# gloo twins), ranks sharing the GPU at W = 2; the main job; the Query eager profile with ranks sharing the GPU.
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=250 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_memory_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" "tests-query:tests/test_query_gpu.py" "tests-output:tests/test_output_gpu.py" > $OUT/check.txt 2>&1
grep -E "^(tests|run)" $OUT/check.txt
PEERDCP_SHARED_GPU=1 timeout 120 python3 scripts/diag/query_eager_profile.py --calls 200 > $OUT/query_eager.txt 2>&1
echo "query eager rc=$?"; grep -E "^rank" $OUT/query_eager.txt | head -4
tar czf $OUT/logs.tgz -C $OUT chk; rm -rf $OUT/chk
