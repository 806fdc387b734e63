#!/usr/bin/env bash
# session 27, call 4 (diagnosis for the next session): the one-CTA selection's SASS and ncu's per-instruction
# stall samples at one row of 128K scores (where does a gather step's time go?)
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
LIB=$(ls .jitcache/peerdcp_topk-*/libpeerdcp_topk.so | head -1)
(cuobjdump -sass $LIB || /usr/local/cuda/bin/cuobjdump -sass $LIB) > $OUT/sass_topk.txt 2>&1
ls -la $OUT
cp bench/results/2026-12-01/s26/call6/ncu_sel.py /tmp/ncu_sel.py
PYTHONPATH=$PWD timeout 240 /usr/local/cuda/bin/ncu --kernel-name regex:topk_select --launch-skip 2 --launch-count 1 --set full --import-source no -o $OUT/sel1x128k python3 /tmp/ncu_sel.py 1 131072 > $OUT/ncu_run.txt 2>&1
/usr/local/cuda/bin/ncu --import $OUT/sel1x128k.ncu-rep --page source --csv --print-source sass > $OUT/source_sass.csv 2>&1
/usr/local/cuda/bin/ncu --import $OUT/sel1x128k.ncu-rep --page details > $OUT/details.txt 2>&1
gzip -9 $OUT/*.txt $OUT/*.csv $OUT/*.ncu-rep 2>/dev/null
ls -la $OUT; tail -3 $OUT/ncu_run.txt 2>/dev/null
