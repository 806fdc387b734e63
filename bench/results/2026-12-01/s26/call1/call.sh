set -u
source scripts/gpu_env.sh
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -2
echo "== local GPU tests"
timeout 240 python3 -m pytest -q -x tests/test_topk_local_gpu.py > $OUT/tests-local.log 2>&1; echo rc=$?
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests-local.log | head
echo "== publish_fused"
timeout 200 python3 scripts/diag/publish_fused.py $OUT/pf --worlds 2 4 > $OUT/publish_fused.log 2>&1; echo rc=$?
grep -E "^\|" $OUT/publish_fused.log
echo "== A/B local select (unfused path)"
AB_DIRS="head:.jitcache/v-head tree:csrc" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=150 bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick
