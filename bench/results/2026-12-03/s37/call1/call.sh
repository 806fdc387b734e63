#!/usr/bin/env bash
# session 37, call 1 (one GPU, ranks sharing it): after the Output/Query bf16 helpers moved to kernel_support
# (to_f32 / cast_rne / f32_to_bf16_bits) and the new checks (local_candidates keys vs reference.pack_keys on the
# CUDA selection, Query back-to-back with precomputed inputs and jitter): the Top-K, Query and Output GPU suites
# and the main job.
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=250 TEST_TIMEOUT=150 bash scripts/gpu_check.sh \
  "tests-topk:tests/test_memory_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" \
  "tests-query:tests/test_query_gpu.py" "tests-output:tests/test_output_gpu.py" > $OUT/check.txt 2>&1
cat $OUT/check.txt | tail -20
grep -hE "passed|failed" $OUT/chk/tests-*.log | tail -6
tar czf $OUT/logs.tgz -C $OUT chk; rm -rf $OUT/chk
