set -u
source scripts/gpu_env.sh
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}
PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" 2>&1 | tail -4
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests-topk.log | head
export PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE
for c in 8 2 1; do echo "== phases C=$c"; python3 scripts/diag/select_phases.py --ctas $c --lengths 4096 16384 65536 131072; done
