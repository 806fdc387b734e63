set -u
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
cp csrc/topk_select.cu /tmp/keep.cu
cp .jitcache/v-diag/topk_select.cu csrc/
for c in 8 2 1; do echo "== diag phases C=$c (radix col = after min/max, trim col = after scan)"; PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE python3 scripts/diag/select_phases.py --ctas $c --lengths 4096 16384 131072; done
for r in 1 2; do for v in head v1; do
  cp .jitcache/v-$v/topk_select.cu csrc/
  timeout 150 python3 -m bench.topk --world 1 --no-merge --no-indexer --local --quick --out $OUT/j-$v$r > $OUT/ab-$v$r.log 2>&1; echo "== $v$r rc=$?"
done; done
cp /tmp/keep.cu csrc/topk_select.cu; rm -rf $OUT/j-*
for f in $OUT/ab-*.log; do echo "##### $f"; grep -E "^ +[0-9]+ +[0-9]+ " $f; done
