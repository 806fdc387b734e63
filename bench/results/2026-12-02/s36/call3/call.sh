#!/usr/bin/env bash
# session 36, call 3 (one GPU): the memory + Top-K suites and the main job after TopK agrees its set-up on every
# backend (3a22b9b), ranks sharing the GPU at W = 2.
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=250 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_memory_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
grep -E "^(tests|run)" $OUT/check.txt
tar czf $OUT/logs.tgz -C $OUT chk; rm -rf $OUT/chk
