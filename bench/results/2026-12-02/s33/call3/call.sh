#!/usr/bin/env bash
# session 33, call 3 (one GPU): normal scores with one far outlier (an attention sink at local row 0, always among the
# estimate's samples): select_dist for tree vs loop1 (the estimate's second round by bits in the one-CTA instances)
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/sd
OUT=$OUT/sd ROUNDS=2 AB_DIRS="tree:csrc loop1:.jitcache/v-loop1" GREP='^\|' STAGE_TIMEOUT=120 bash scripts/ab_bench.sh scripts/diag/select_dist.py --rows 1 32 128 --lengths 16384 65536 131072 --kinds normal sink100 sink1000 sink10000 > $OUT/sd.txt 2>&1
cat $OUT/sd.txt
tar czf $OUT/logs.tgz -C $OUT sd; rm -rf $OUT/sd
