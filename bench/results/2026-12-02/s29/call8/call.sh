#!/usr/bin/env bash
# session 29, call 8: the CUDA scan's pages per CTA (cuda_scan_npage forced) around the rule's one-wave choice at
# issue 5's two missed ratios (32 x 32K, 8 x 128K; DeepSeek-V3.2, 64 heads), one-GPU emulation of W = 2
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
V=(); for n in 8 10 11 12 14 16 22 24 32; do V+=(--variant "n$n:cuda_scan_npage=$n"); done
timeout 200 python3 scripts/diag/score_sweep.py $OUT/np --emulate --world 2 --heads 64 --rows 8 32 --contexts 32768 131072 --configs "${V[@]}" --rounds 2 > $OUT/np.txt 2>&1
grep -v "^#\|^regs" $OUT/np.txt | tail -45
