set -u
source scripts/gpu_env.sh
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}
timeout 200 python3 -m pytest -q -x --timeout=120 -p no:cacheprovider -m "cuda or multigpu" tests/test_topk_local_gpu.py 2>&1 | tail -4
AB_DIR=.jitcache/src-A ROUNDS=1 TAIL=22 bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick 2>&1 | grep -E "^==|#####|^ +[0-9]+ +[0-9]+ "
export PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE
for C in 1 8; do python3 scripts/diag/select_phases.py --ctas $C --lengths 16384 131072; done
