#!/usr/bin/env bash
# session 31, call 1: bucket_top's inner phases (trace builds: stamps at its entry, after the key range, the
# histogram, the scan, the scatter; then after it returns) on the tree and on a BLOCK_SCAN_WARP_SCANS variant (ws);
# the local-selection GPU tests on ws; tree vs ws A/B at every shape, unforced and forced (4 + 64 tokens)
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/abf
cp csrc/topk_select.cu /tmp/sel_tree.cu
for v in trace wstrace; do
  cp .jitcache/v-$v/topk_select.cu csrc/
  echo "== $v (slots: sample=bt entry, estimate=after range, radix=after hist, trim=after scan, funnel=after scatter, sort=bt returned)"
  PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE timeout 60 python3 scripts/diag/select_phases.py --lengths 2048 4096 8192 16384 131072 2>&1 | tail -6
  PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE timeout 60 python3 scripts/diag/select_phases.py --ctas 1 --lengths 16384 65536 2>&1 | tail -3
done
cp .jitcache/v-ws/topk_select.cu csrc/
timeout 200 python3 -m pytest -q -x tests/test_topk_local_gpu.py -p no:cacheprovider > $OUT/test_ws.txt 2>&1
echo "== ws tests rc=$?: $(tail -1 $OUT/test_ws.txt)"
cp /tmp/sel_tree.cu csrc/topk_select.cu
B="tree:csrc ws:.jitcache/v-ws"
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
OUT=$OUT/ab ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A > $OUT/ab.txt 2>&1
OUT=$OUT/abf ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A --local-force 4,64 > $OUT/abf.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
python3 scripts/ab_local_table.py $OUT/abf > $OUT/abf_table.txt 2>&1
echo "== A/B unforced"; cat $OUT/ab_table.txt
echo "== A/B forced 4,64"; cat $OUT/abf_table.txt
tar czf $OUT/logs.tgz -C $OUT ab abf 2>/dev/null; rm -rf $OUT/ab $OUT/abf
