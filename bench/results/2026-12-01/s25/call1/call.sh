set -u
source scripts/gpu_env.sh
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}
PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" 2>&1 | tail -4
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests-topk.log | head
AB_DIR=.jitcache/src-A ROUNDS=2 TAIL=22 bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick 2>&1 | grep -E "^==|#####|^ +[0-9]+ +[0-9]+ "
export PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE
for c in 8 2 1; do echo "== B phases C=$c"; python3 scripts/diag/select_phases.py --ctas $c --lengths 4096 16384 65536 131072; done
cp csrc/topk_select.cu /tmp/selB.cu; cp .jitcache/src-A/topk_select.cu csrc/
for c in 8 2 1; do echo "== A phases C=$c"; python3 scripts/diag/select_phases.py --ctas $c --lengths 4096 16384 65536 131072; done
cp /tmp/selB.cu csrc/topk_select.cu
