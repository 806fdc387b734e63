#!/usr/bin/env bash
# session 34, call 5 (one GPU): the kept tree (bucket_top unchanged: production PTX identical to HEAD; the trace build
# counts the estimate's passes and bucket_top's retries): the local GPU tests with the speed guard and 3 new exactness
# cases, and the phase table of the trace build.
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/chk
OUT=$OUT/chk STAGE_TIMEOUT=300 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-local:tests/test_topk_local_gpu.py" > /dev/null 2>&1
PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE timeout 120 python3 scripts/diag/select_phases.py --lengths 4096 16384 131072 --kinds normal sink1e4 sink-1e30 cauchy > $OUT/phases.txt 2>&1
grep -E "passed|failed|FAILED" $OUT/chk/tests-local.log | tail -4; grep -E "ignores_one_far|sinks-T3-L4096|sinks-T3-L2000|outlier-T3-L4096" $OUT/chk/tests-local.log | head; cat $OUT/phases.txt
