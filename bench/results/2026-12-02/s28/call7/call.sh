#!/usr/bin/env bash
# session 28, call 7: the committed tree with call 6's bucket_top range (one comment line added) - the Top-K GPU suites
# (ranks sharing the GPU) and the main job
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
echo "== check"; sed -n '/-------- summary/,$p' $OUT/check.txt
