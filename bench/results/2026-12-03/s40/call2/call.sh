#!/usr/bin/env bash
# session 40, call 2 (one GPU, 8 ranks sharing it): the W = 8 instantiations after call 1's changes - the memory +
# Top-K suites (peer_pointer's alignment hint in the Top-K publish / merge kernels), the main job (bytewise query
# check) and the Query suite (the rounding bound; at W = 8 the kimi-k2 case's seed put correct results up to 14
# bf16 steps from fp64 on CPU).
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
export PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=8
OUT=$OUT/chk STAGE_TIMEOUT=300 TEST_TIMEOUT=200 bash scripts/gpu_check.sh \
  "tests-mt:tests/test_memory_gpu.py tests/test_topk_gpu.py" \
  "run:--world 8 --geometry deepseek-v3.2 --rows 1,8,64 --context 32768" "tests-query:tests/test_query_gpu.py" > $OUT/check.txt 2>&1
sed -n '/-------- summary/,$p' $OUT/check.txt
tar czf $OUT/logs.tgz -C $OUT chk; rm -rf $OUT/chk
