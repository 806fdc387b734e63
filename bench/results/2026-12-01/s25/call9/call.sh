set -u
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
cp csrc/topk_select.cu /tmp/keep.cu; cp .jitcache/v-fz/topk_select.cu csrc/
echo "== tests fz"; timeout 200 python3 -m pytest -q -x tests/test_topk_local_gpu.py -k "local_candidates or select" 2>&1 | tail -1
cp /tmp/keep.cu csrc/topk_select.cu
echo "== unforced"; AB_DIRS="head:.jitcache/v-head fz:.jitcache/v-fz" GREP='^ +[0-9]+ +[0-9]+ ' bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick
mkdir -p $OUT/forced; echo "== forced 4,64"; OUT=$OUT/forced AB_DIRS="head:.jitcache/v-head fz:.jitcache/v-fz" GREP='^ +[0-9]+ +[0-9]+ ' bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick --local-force 4,64
