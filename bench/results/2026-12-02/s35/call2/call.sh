#!/usr/bin/env bash
# session 35, call 2 (one GPU): the Top-K audit fixes (seq_lens stride, block_table / indexer_logits / write checks,
# force bounds, TopK argument agreement, timeout bound) and session 35's memory changes under the Top-K suites with
# ranks sharing the GPU (W = 2), incl. the new test_gpu_audit_inputs_raise; the main job at W = 2; the Query suite again
# (the Triton kernels' bf16 widening by bits under the interpreter: the GPU branch is unchanged).
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
ls .jitcache > $OUT/jit_before.txt
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=250 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_memory_gpu.py tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" "tests-query:tests/test_query_gpu.py" > $OUT/check.txt 2>&1
grep -E "^tests|^run|^FAILED|^ERROR" $OUT/check.txt | tail -8
grep -E "audit_inputs|test_gpu_bad_input" $OUT/chk/tests-topk.log | head -4
ls .jitcache > $OUT/jit_after.txt; echo "== new cache entries:"; diff $OUT/jit_before.txt $OUT/jit_after.txt
tar czf $OUT/logs.tgz -C $OUT chk; rm -rf $OUT/chk
