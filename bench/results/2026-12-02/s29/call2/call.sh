#!/usr/bin/env bash
# session 29, call 2: (a) the selection kernel's start without divisions (row / cluster rank from %clusterid /
# %cluster_ctarank, the local length in 32 bits): store (call 1's tree) vs start A/B, every shape, with and without
# forced tokens, and the local GPU tests on it; (b) the merge launched with PDL after the publishing selection
# (x_pdl) against without (x_fused) at 1-64 rows, W = 2 and 4, by one-GPU emulation, in two processes
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/abf $OUT/pdl1 $OUT/pdl2
timeout 200 python3 -m pytest -q -x -m "cuda or multigpu" --timeout=150 -p no:cacheprovider tests/test_topk_local_gpu.py > $OUT/tests-local.txt 2>&1
tail -2 $OUT/tests-local.txt
B="store:.jitcache/v-store start:csrc"
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
OUT=$OUT/ab ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A > $OUT/ab.txt 2>&1
OUT=$OUT/abf ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A --local-force 4,64 > $OUT/abf.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
python3 scripts/ab_local_table.py $OUT/abf > $OUT/abf_table.txt 2>&1
for r in 1 2; do
  timeout 150 python3 scripts/diag/publish_fused.py $OUT/pdl$r --worlds 2 4 --rows 1 2 4 8 16 32 64 --lengths 16384 65536 --exchange > $OUT/pdl$r.txt 2>&1
done
tar czf $OUT/logs.tgz -C $OUT ab abf pdl1 pdl2 2>/dev/null; rm -rf $OUT/ab $OUT/abf $OUT/pdl1 $OUT/pdl2
echo "== A/B unforced"; cat $OUT/ab_table.txt
echo "== A/B forced 4,64"; cat $OUT/abf_table.txt
echo "== pdl 1"; tail -30 $OUT/pdl1.txt
echo "== pdl 2"; tail -30 $OUT/pdl2.txt
echo "== local tests"; tail -2 $OUT/tests-local.txt
