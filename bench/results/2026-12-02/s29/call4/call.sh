#!/usr/bin/env bash
# session 29, call 4: (a) select_ctas's rule against every forced C at 8-64 rows of 8K / 16K / 32K local scores
# (call 3: 16K x 32 rows took C = 2 at 13.94 us, one CTA 13.67); (b) the merge by PDL at rows of <= 4K scores (one
# selection CTA per row: the "auto" rule allows up to 14 rows at W = 2), where call 2 did not measure it
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/pdl
timeout 240 python3 scripts/diag/select_ctas_sweep.py --lengths 8192 16384 32768 --rows 8 16 24 32 48 64 > $OUT/ctas.txt 2>&1
timeout 200 python3 scripts/diag/publish_fused.py $OUT/pdl --worlds 2 4 --rows 1 4 8 14 16 32 --lengths 2048 4096 --exchange > $OUT/pdl.txt 2>&1
echo "== ctas"; cat $OUT/ctas.txt | tail -25
echo "== pdl"; grep -v "^{" $OUT/pdl.txt | tail -30
