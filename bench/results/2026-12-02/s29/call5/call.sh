#!/usr/bin/env bash
# session 29, call 5: the final tree (select_ctas: a cluster only where it spares each CTA > 8192 scores):
# Top-K GPU suites and the main job with ranks sharing the GPU (W = 2); the CTAs sweep at 1-32 rows of 8K / 12K /
# 16K scores (the new rule's boundary: C = 8 from 9363 scores on); bench.topk's local table at 8K / 16K
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/chk $OUT/loc
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
timeout 200 python3 scripts/diag/select_ctas_sweep.py --lengths 8192 12288 16384 --rows 1 2 4 8 16 32 > $OUT/ctas.txt 2>&1
timeout 120 python3 -m bench.topk --out $OUT/loc --world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 8192,16384 > $OUT/local.txt 2>&1
gzip -9 $OUT/chk/tests-topk.log; cp $OUT/chk/tests-topk.log.gz $OUT/chk/run.json $OUT/ 2>/dev/null; rm -rf $OUT/chk $OUT/loc
echo "== ctas"; tail -20 $OUT/ctas.txt
echo "== local"; grep -E "^ +[0-9]+ +[0-9]+ |local_len" $OUT/local.txt
echo "== check"; tail -5 $OUT/check.txt
