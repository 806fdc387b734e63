set -u
source scripts/gpu_env.sh
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=240 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
grep -E "PASS|FAIL" $OUT/run.log | tail -1
echo "== tests"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests-topk.log | head -20
