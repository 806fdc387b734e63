set -u
source scripts/gpu_env.sh
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}
AB_DIR=.jitcache/src-A ROUNDS=1 TAIL=22 bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick 2>&1 | grep -E "^==|#####|^ +[0-9]+ +[0-9]+ "
PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=330 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" 2>&1 | tail -5
grep -E "^(FAILED|ERROR)" $OUT/tests-topk.log | head
export PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE
for C in 2 8; do python3 scripts/diag/select_phases.py --ctas $C --lengths 16384 131072; done
