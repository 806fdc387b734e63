#!/usr/bin/env bash
# session 33, call 5 (one GPU): select_dist on the kept kernel (outlier-robust range), normal and indexer scores -
# the same inputs as call 1's tree (= head) run
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
timeout 55 python3 scripts/diag/select_dist.py --rows 1 128 --lengths 2048 4096 16384 65536 131072 --kinds normal indexer > $OUT/sd.txt 2>&1
cat $OUT/sd.txt
