#!/usr/bin/env bash
# session 34, call 6 (one GPU): why a robust key range in bucket_top's first map costs clean rows ~0.45 us:
# dead = the warps variant with its range code behind a condition never true at run time (count < 0; the per-warp
# stores still run) against the tree (prev) and warps. Code presence/layout vs execution.
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
OUT=$OUT/ab ROUNDS=2 AB_DIRS="prev:csrc dead:.jitcache/v-dead warps:.jitcache/v-warps" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick --local-rows 1,128 --local-lengths 2048,4096,16384,131072 > $OUT/ab.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
tar czf $OUT/logs.tgz -C $OUT ab; rm -rf $OUT/ab
cat $OUT/ab_table.txt
