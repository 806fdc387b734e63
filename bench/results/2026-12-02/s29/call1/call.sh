#!/usr/bin/env bash
# session 29, call 1: (a) the selection's per-lane store loop as one lambda (store_taken, key as a callable) in
# the fast and the whole-key gather: head (ee243ee) vs tree A/B at every shape, with and without forced tokens, and
# the local GPU tests on the tree; (b) TopK.select's eager host time (ranks sharing the GPU, host columns only);
# (c) ncu of 128 rows x 4K on the tree after session 28's bucket_top change (per-instruction stall samples)
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/abf $OUT/ncu
timeout 200 python3 -m pytest -q -x -m "cuda or multigpu" --timeout=150 -p no:cacheprovider tests/test_topk_local_gpu.py > $OUT/tests-local.txt 2>&1
tail -2 $OUT/tests-local.txt
B="head:.jitcache/v-head tree:csrc"
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
OUT=$OUT/ab ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A > $OUT/ab.txt 2>&1
OUT=$OUT/abf ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A --local-force 4,64 > $OUT/abf.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
python3 scripts/ab_local_table.py $OUT/abf > $OUT/abf_table.txt 2>&1
PEERDCP_SHARED_GPU=1 timeout 120 python3 scripts/diag/topk_eager_profile.py --world 2 --rows 8 --calls 300 > $OUT/eager.txt 2>&1
LIB=$(ls -d .jitcache/peerdcp_topk-7e098e68ffb786a2)/libpeerdcp_topk.so
cp bench/results/2026-12-01/s26/call6/ncu_sel.py /tmp/ncu_sel.py
PYTHONPATH=$PWD timeout 200 /usr/local/cuda/bin/ncu --kernel-name regex:topk_select --launch-skip 2 --launch-count 1 --set full --warp-sampling-interval 0 --import-source no -o $OUT/ncu/sel128x4k python3 /tmp/ncu_sel.py 128 4096 > $OUT/ncu/ncu_run.txt 2>&1
/usr/local/cuda/bin/ncu --import $OUT/ncu/sel128x4k.ncu-rep --page source --csv --print-source sass > $OUT/ncu/source_sass.csv 2>&1
/usr/local/cuda/bin/ncu --import $OUT/ncu/sel128x4k.ncu-rep --page details > $OUT/ncu/details.txt 2>&1
/usr/local/cuda/bin/cuobjdump -sass $LIB > $OUT/ncu/sass_topk.txt 2>&1
tar czf $OUT/logs.tgz -C $OUT ab abf ncu 2>/dev/null; rm -rf $OUT/ab $OUT/abf $OUT/ncu
echo "== eager"; tail -40 $OUT/eager.txt
echo "== A/B unforced"; cat $OUT/ab_table.txt
echo "== A/B forced 4,64"; cat $OUT/abf_table.txt
echo "== local tests"; tail -2 $OUT/tests-local.txt
