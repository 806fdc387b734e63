#!/usr/bin/env bash
# session 34, call 4 (one GPU): bucket_top's robust key range by warp extremes (the 4th largest / smallest warp
# maximum / minimum, plain stores, no atomics; used where the whole range is > 2x it) in both maps (the tree) against
# prev (the tree before it): local GPU tests incl. the speed guard, phases, A/B; then the Top-K suites with ranks
# sharing the GPU and the main job at W = 2.
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/chk
OUT=$OUT/chk STAGE_TIMEOUT=300 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-local:tests/test_topk_local_gpu.py" > /dev/null 2>&1
ph() { PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE timeout 120 python3 scripts/diag/select_phases.py --lengths 4096 16384 131072 --kinds normal sink1e4 sink-1e30 cauchy "$@"; }
{ echo "== tree, rule"; ph; echo "== tree, ctas 1"; ph --ctas 1; } > $OUT/phases.txt 2>&1
B="prev:.jitcache/v-prev tree:csrc"
OUT=$OUT/ab ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072 > $OUT/ab.txt 2>&1
OUT=$OUT/ab2 ROUNDS=1 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072 --local-force 4,64 > $OUT/ab2.txt 2>&1
OUT=$OUT/sd ROUNDS=1 AB_DIRS="$B" GREP='^\|' STAGE_TIMEOUT=150 bash scripts/ab_bench.sh scripts/diag/select_dist.py --rows 1 32 128 --lengths 4096 16384 131072 --kinds normal indexer sink1e4 sink-1e30 cauchy > $OUT/sd.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab2 > $OUT/ab2_table.txt 2>&1
OUT=$OUT/suites PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=250 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_memory_gpu.py tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/suites.txt 2>&1
tar czf $OUT/logs.tgz -C $OUT chk ab ab2 sd suites 2>/dev/null; rm -rf $OUT/chk $OUT/ab $OUT/ab2 $OUT/sd $OUT/suites
tar xzf $OUT/logs.tgz -O chk/tests-local.log | grep -E "passed|failed|FAILED" | tail -4
tail -n 8 $OUT/suites.txt
cat $OUT/phases.txt $OUT/ab_table.txt $OUT/ab2_table.txt; grep -v '^==' $OUT/sd.txt
