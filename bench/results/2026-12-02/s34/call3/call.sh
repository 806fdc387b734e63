#!/usr/bin/env bash
# session 34, call 3 (one GPU): bucket_top's robust key range, two forms against prev (the tree before it):
# retry = only bucket_top<true> (the retry by bits) maps over the robust range (the tree); always = both maps, when the
# whole range is > 2x the robust one, group atomics (v-always). Local GPU tests on the tree; phases; A/B.
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/chk
OUT=$OUT/chk STAGE_TIMEOUT=300 TEST_TIMEOUT=150 PYTEST_K="not ignores_one_far" bash scripts/gpu_check.sh "tests-local:tests/test_topk_local_gpu.py" > /dev/null 2>&1
PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE timeout 120 python3 scripts/diag/select_phases.py --lengths 4096 16384 131072 --kinds normal sink1e4 sink-1e30 cauchy > $OUT/phases.txt 2>&1
B="prev:.jitcache/v-prev retry:csrc always:.jitcache/v-always"
OUT=$OUT/ab ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072 > $OUT/ab.txt 2>&1
OUT=$OUT/ab2 ROUNDS=1 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072 --local-force 4,64 > $OUT/ab2.txt 2>&1
OUT=$OUT/sd ROUNDS=1 AB_DIRS="$B" GREP='^\|' STAGE_TIMEOUT=150 bash scripts/ab_bench.sh scripts/diag/select_dist.py --rows 1 32 128 --lengths 4096 16384 131072 --kinds normal sink1e4 sink-1e30 cauchy > $OUT/sd.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab2 > $OUT/ab2_table.txt 2>&1
tar czf $OUT/logs.tgz -C $OUT chk ab ab2 sd 2>/dev/null; rm -rf $OUT/chk $OUT/ab $OUT/ab2 $OUT/sd
tar tzf $OUT/logs.tgz >/dev/null; tar xzf $OUT/logs.tgz -O chk/tests-local.log | grep -E "passed|failed|FAILED" | tail -4
cat $OUT/phases.txt $OUT/ab_table.txt $OUT/ab2_table.txt; grep -v '^==' $OUT/sd.txt
