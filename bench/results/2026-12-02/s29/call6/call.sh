#!/usr/bin/env bash
# session 29, call 6: the CUDA indexer scan at 1-4 query rows (cuda_scan_min_rows = 4 since session 23, which
# measured the CUDA kernel at one row only): lib (auto) / cuda / triton, one-GPU emulation of W = 2, both layouts,
# DeepSeek-V3.2 (64 heads) and GLM-5 (32 heads)
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
for H in 64 32; do
  timeout 250 python3 scripts/diag/score_sweep.py $OUT/ss$H --emulate --world 2 --heads $H --rows 1 2 3 4 --contexts 32768 65536 131072 --configs --variant 'cuda:scan_backend="cuda"' --variant 'triton:scan_backend="triton"' --rounds 2 > $OUT/ss$H.txt 2>&1
  echo "== heads $H"; grep -v "^#" $OUT/ss$H.txt | tail -45
done
