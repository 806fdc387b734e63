set -u
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
cp csrc/topk_select.cu /tmp/keep.cu
for v in ge mm both; do cp .jitcache/v-$v/topk_select.cu csrc/; echo "== tests $v"; timeout 200 python3 -m pytest -q -x tests/test_topk_local_gpu.py -k "local_candidates or select" 2>&1 | tail -1; done
cp /tmp/keep.cu csrc/topk_select.cu
AB_DIRS="head:.jitcache/v-head ge:.jitcache/v-ge mm:.jitcache/v-mm both:.jitcache/v-both" GREP='^ +[0-9]+ +[0-9]+ ' bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick
