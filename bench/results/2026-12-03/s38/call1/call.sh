#!/usr/bin/env bash
# session 38, call 1 (one GPU, ranks sharing it): the Query GPU suite after _cvt's bf16 branch became kernel_support.cast_rne
# (call 4: the same suite after the back-to-back plan gained runs of
# consecutive zero-copy calls).
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=250 TEST_TIMEOUT=150 bash scripts/gpu_check.sh \
  "tests-query:tests/test_query_gpu.py" > $OUT/check.txt 2>&1
tail -8 $OUT/check.txt
tar czf $OUT/logs.tgz -C $OUT chk; rm -rf $OUT/chk
