#!/usr/bin/env bash
# session 35, call 1 (one GPU): the audit fixes on GPU paths (jit's source lookup, memory teardown / argument
# agreement / current-device restore, Output combine int64 offsets + auto fallback, Query Triton pe_region int64,
# timeout bounds): the memory, JIT, Query and Output GPU suites with ranks sharing the GPU (W = 2). Then lists
# .jitcache, to show no library was rebuilt (the cache keys did not change).
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
ls .jitcache > $OUT/jit_before.txt
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=170 TEST_TIMEOUT=150 bash scripts/gpu_check.sh env "tests-mem:tests/test_memory_gpu.py tests/test_jit_gpu.py" "tests-query:tests/test_query_gpu.py" "tests-output:tests/test_output_gpu.py" > $OUT/check.txt 2>&1
grep -E "^tests|^run|^env" $OUT/check.txt | tail -8
ls .jitcache > $OUT/jit_after.txt; echo "== new cache entries:"; diff $OUT/jit_before.txt $OUT/jit_after.txt
grep -E "^torch|^3\." $OUT/chk/env.log | head -3
tar czf $OUT/logs.tgz -C $OUT chk; rm -rf $OUT/chk
