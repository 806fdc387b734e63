set -u
source scripts/gpu_env.sh
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=300 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" 2>&1 | tail -4
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests-topk.log | head
echo "== unforced"; ROUNDS=3 AB_DIRS="abi:.jitcache/v-abi tree:csrc" GREP='^ +[0-9]+ +[0-9]+ ' bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick
mkdir -p $OUT/forced; echo "== forced 4,64"; OUT=$OUT/forced AB_DIRS="abi:.jitcache/v-abi tree:csrc" GREP='^ +[0-9]+ +[0-9]+ ' bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick --local-force 4,64
