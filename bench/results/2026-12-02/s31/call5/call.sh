#!/usr/bin/env bash
# session 31, call 5 (diagnosis for the next session): ncu's per-instruction stall samples of the one-CTA selection
# at 128 rows of 4096 scores after the block-scan change (gather_all + bucket_top), and the SASS of the library
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
LIB=.jitcache/peerdcp_topk-9167fb2611509a49/libpeerdcp_topk.so
/usr/local/cuda/bin/cuobjdump -sass $LIB > $OUT/sass_topk.txt 2>&1
cp bench/results/2026-12-01/s26/call6/ncu_sel.py /tmp/ncu_sel.py
PYTHONPATH=$PWD timeout 300 /usr/local/cuda/bin/ncu --kernel-name regex:topk_select --launch-skip 2 --launch-count 1 --set full --warp-sampling-interval 0 --import-source no -o $OUT/sel128x4k python3 /tmp/ncu_sel.py 128 4096 > $OUT/ncu_run.txt 2>&1
/usr/local/cuda/bin/ncu --import $OUT/sel128x4k.ncu-rep --page source --csv --print-source sass > $OUT/source_sass.csv 2>&1
/usr/local/cuda/bin/ncu --import $OUT/sel128x4k.ncu-rep --page details > $OUT/details.txt 2>&1
grep -E "Duration|Elapsed Cycles|Executed Ipc A|Warp Cycles Per Issued|Issue Slots Busy|No Eligible" $OUT/details.txt | head -12
gzip -9 $OUT/*.txt $OUT/*.csv $OUT/*.ncu-rep 2>/dev/null
ls -la $OUT; zcat $OUT/ncu_run.txt.gz | tail -3
