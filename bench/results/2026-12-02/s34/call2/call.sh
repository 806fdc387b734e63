#!/usr/bin/env bash
# session 34, call 2 (one GPU): bucket_top's robust key range (a gathered sink no longer sends it to the retry by
# bits). The local GPU tests on the tree; the speed guard on the two kernels before it (a3fe001: must fail on the
# radix select; prev + counters: must fail on bucket_top's retries); phase tables; A/B prev vs tree.
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/chk $OUT/ab $OUT/sd
OUT=$OUT/chk STAGE_TIMEOUT=300 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-local:tests/test_topk_local_gpu.py" > /dev/null 2>&1
ph() { PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE timeout 120 python3 scripts/diag/select_phases.py --lengths 4096 16384 65536 131072 --kinds normal sink1000 sink1e4 sink-1e30 cauchy "$@"; }
{ echo "== tree, rule"; ph; echo "== tree, ctas 1"; ph --ctas 1; } > $OUT/phases.txt 2>&1
cp csrc/topk_select.cu /tmp/tree_select.cu
for v in head prevc; do
  cp .jitcache/v-$v/topk_select.cu csrc/topk_select.cu
  timeout 200 python3 -m pytest -q -rfE --tb=line -p no:cacheprovider -m cuda -k ignores_one_far tests/test_topk_local_gpu.py > $OUT/guard_$v.log 2>&1; echo "$v kernel: pytest rc=$?" >> $OUT/guard_$v.log
done
{ echo "== prev+counters, rule"; ph; } >> $OUT/phases.txt 2>&1
cp /tmp/tree_select.cu csrc/topk_select.cu
OUT=$OUT/ab ROUNDS=2 AB_DIRS="prev:.jitcache/v-prev tree:csrc" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072 > $OUT/ab.txt 2>&1
OUT=$OUT/ab2 ROUNDS=1 AB_DIRS="prev:.jitcache/v-prev tree:csrc" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072 --local-force 4,64 > $OUT/ab2.txt 2>&1
OUT=$OUT/sd ROUNDS=1 AB_DIRS="prev:.jitcache/v-prev tree:csrc" GREP='^\|' STAGE_TIMEOUT=150 bash scripts/ab_bench.sh scripts/diag/select_dist.py --rows 1 32 128 --lengths 4096 16384 131072 --kinds normal sink1e4 cauchy > $OUT/sd.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab2 > $OUT/ab2_table.txt 2>&1
tar czf $OUT/logs.tgz -C $OUT chk ab ab2 sd 2>/dev/null
grep -E "passed|failed" $OUT/chk/tests-local.log | tail -2; grep -E "FAILED" $OUT/chk/tests-local.log | head
for v in head prevc; do tail -n 6 $OUT/guard_$v.log; done
cat $OUT/phases.txt; cat $OUT/ab_table.txt $OUT/ab2_table.txt; cat $OUT/sd.txt
