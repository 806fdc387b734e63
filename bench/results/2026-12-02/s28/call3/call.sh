#!/usr/bin/env bash
# session 28, call 3: the final tree (a1f0688 + 09d59e1: gather_all for rows of <= 4K, the whole-key path's per-lane
# stores; host-check builds only without a GPU) - the Top-K, Query and Output GPU suites with ranks sharing the GPU,
# the main job; then the selection's phase stamps at 4K-16K scores, one CTA (where a 4K row's ~8.3 us go)
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "tests-query:tests/test_query_gpu.py" "tests-output:tests/test_output_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE timeout 120 python3 scripts/diag/select_phases.py --lengths 2048 4096 8192 16384 --ctas 1 > $OUT/phases.txt 2>&1
PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE timeout 120 python3 scripts/diag/select_phases.py --lengths 4096 16384 65536 131072 >> $OUT/phases.txt 2>&1
echo "== phases"; cat $OUT/phases.txt
echo "== check"; sed -n '/-------- summary/,$p' $OUT/check.txt
