#!/usr/bin/env bash
set -u
cd "$(dirname "$0")"
OUT=${OUT:-$PWD/out}
PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=300 TEST_TIMEOUT=150 \
  bash scripts/gpu_check.sh "tests-topk:tests/test_topk_gpu.py tests/test_topk_merge_gpu.py tests/test_topk_local_gpu.py" "run:--world 2" | grep -E "^==|passed|failed|PASS|FAIL"
STAGE_TIMEOUT=150 bash scripts/gpu_check.sh "py-sweep:scripts/diag/score_sweep.py $OUT/sweep --emulate --world 2 --configs --rows 1 4 8 32 128 --rounds 1 --iters 20 --variant triton:scan_backend=\"triton\"" >/dev/null
grep -E "^ *[0-9]+ +[0-9]+ " $OUT/py-sweep.log
