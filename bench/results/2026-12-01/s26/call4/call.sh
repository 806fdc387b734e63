set -u
source scripts/gpu_env.sh
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
echo "== publish_fused --exchange"
timeout 300 python3 scripts/diag/publish_fused.py $OUT/pf --worlds 2 4 --exchange > $OUT/publish_fused.log 2>&1; echo rc=$?
grep -vE '^\{' $OUT/publish_fused.log | tail -25
PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=300 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
tail -4 $OUT/check.txt
grep -E "PASS|FAIL" $OUT/run.log | tail -2
echo "== tests"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests-topk.log | head -20
