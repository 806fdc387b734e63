#!/usr/bin/env bash
# session 29, call 7: the CUDA scan's new row thresholds (every row count with <= 32 heads, 3 rows on with 64):
# Top-K GPU suites with ranks sharing the GPU (W = 2), and the main job at 1-3 rows for GLM-5 (32 heads: now the
# CUDA scan at 1 row) and DeepSeek-V3.2 (64 heads: the CUDA scan at 3 rows), checked against the unsharded step
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/chk
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py" "py-glm:-m peerdcp run --world 2 --geometry glm-5 --rows 1,2,3" "py-ds:-m peerdcp run --world 2 --geometry deepseek-v3.2 --rows 2,3" > $OUT/check.txt 2>&1
gzip -9 $OUT/chk/*.log; cp $OUT/chk/*.log.gz $OUT/ 2>/dev/null; rm -rf $OUT/chk
tail -8 $OUT/check.txt
