#!/usr/bin/env bash
# session 30, call 2: (a) the merge by PDL after the publishing selection, x_fused vs x_pdl by one-GPU emulation of
# rank 0's exchange at W = 2 / 4, 8-32 rows of 2K / 4K / 16K local scores (two processes, for the spread); (b) the
# local selection's phases (CTA 0's %globaltimer stamps) at one row, one CTA and the rule's C
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
for r in 1 2; do
  timeout 200 python3 scripts/diag/publish_fused.py $OUT/pf$r --worlds 2 4 --rows 8 10 12 14 16 20 24 32 --lengths 2048 4096 16384 --exchange > $OUT/pdl$r.txt 2>&1
  echo "== pdl round $r rc=$?"; grep -v "^{" $OUT/pdl$r.txt | tail -52
  if [ $r = 1 ]; then
    export PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE
    echo "== phases, one CTA"; timeout 60 python3 scripts/diag/select_phases.py --ctas 1 --lengths 2048 4096 8192 16384 65536 131072 2>&1 | tail -8
    echo "== phases, the rule's C"; timeout 50 python3 scripts/diag/select_phases.py --lengths 16384 65536 131072 2>&1 | tail -5
    unset PEERDCP_NVCC_EXTRA
  fi
done > $OUT/all.txt 2>&1
cat $OUT/all.txt
