set -u
source scripts/gpu_env.sh
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=300 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
tail -4 $OUT/check.txt
grep -E "PASS|FAIL" $OUT/run.log | tail -2
grep -E "mixed" $OUT/tests-topk.log
echo "== tests"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests-topk.log | head -20
