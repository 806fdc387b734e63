#!/usr/bin/env bash
# session 30, call 8 (review): one cuda_index helper for the device-ordinal idiom (topk ops / selector, memory vmm /
# symm, kernel_support), merge_pdl's two branches as one formula: memory + Top-K GPU suites and the main job with
# ranks sharing the GPU (W = 2)
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=250 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_memory_gpu.py tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
grep -E "passed|failed|error|PASS|FAIL" $OUT/check.txt | tail -5
