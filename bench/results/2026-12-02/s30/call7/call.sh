#!/usr/bin/env bash
# session 30, call 7: the merge by PDL at W = 8 past the rule's boundary (one merge CTA per SM there: the rule stops at
# 4 one-CTA rows), x_fused vs x_pdl by one-GPU emulation, 6-16 rows of 2K / 8K local scores, two rounds
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
for r in 1 2; do
  timeout 200 python3 scripts/diag/publish_fused.py $OUT/w8r$r --worlds 8 --rows 6 8 10 12 16 --lengths 2048 8192 --exchange > $OUT/w8r$r.txt 2>&1
done
for f in $OUT/w8r*.txt; do echo "== $f"; grep -v "^{" $f | tail -12; done
