#!/usr/bin/env bash
# session 30, call 3: the new "auto" PDL rule's boundaries (one-CTA selections: merge CTAs counted by the SMs they
# fill), x_fused vs x_pdl by one-GPU emulation of rank 0's exchange: W = 2 at 24-28 rows, W = 4 at 6-16 rows,
# W = 8 at 2-6 rows (one merge CTA per SM there), rows of 2K / 8K local scores (one CTA each); two rounds
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
for r in 1 2; do
  timeout 120 python3 scripts/diag/publish_fused.py $OUT/w2r$r --worlds 2 --rows 24 26 27 28 --lengths 2048 8192 --exchange > $OUT/w2r$r.txt 2>&1
  timeout 120 python3 scripts/diag/publish_fused.py $OUT/w4r$r --worlds 4 --rows 6 8 14 15 16 --lengths 2048 8192 --exchange > $OUT/w4r$r.txt 2>&1
  timeout 120 python3 scripts/diag/publish_fused.py $OUT/w8r$r --worlds 8 --rows 2 4 5 6 --lengths 2048 8192 --exchange > $OUT/w8r$r.txt 2>&1
done
for f in $OUT/w*.txt; do echo "== $f"; grep -v "^{" $f | tail -12; done
