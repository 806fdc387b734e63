set -u
source scripts/gpu_env.sh
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
echo "== publish_fused"
timeout 200 python3 scripts/diag/publish_fused.py $OUT/pf --worlds 2 4 > $OUT/publish_fused.log 2>&1; echo rc=$?
grep -E "^\|" $OUT/publish_fused.log
echo "== eager profile (ranks share the GPU: host columns only)"
PEERDCP_SHARED_GPU=1 timeout 120 python3 scripts/diag/topk_eager_profile.py --world 2 --rows 8 > $OUT/eager.log 2>&1; echo rc=$?
head -30 $OUT/eager.log
PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=300 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" 2>&1 | tail -4
grep -E "PASS|FAIL" $OUT/run.log | tail -3
echo "== tests"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests-topk.log | head -20
