#!/usr/bin/env bash
# session 31, call 2: bucket_top after call 1 - a one-barrier block scan of shuffles (scan) and each scattered key's
# bucket kept beside it (ids), both in the tree: phases of the tree (trace build; head's in call 1), the memory + Top-K GPU suites
# on the tree with ranks sharing the GPU (W = 2) and the main job, then head / scan / tree A/B at every shape
# unforced and head / tree forced (4 + 64 tokens)
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/abf
cp csrc/topk_select.cu /tmp/sel_tree.cu
for v in newtrace; do
  cp .jitcache/v-$v/topk_select.cu csrc/
  echo "== $v (slots: sample=bt entry, estimate=after range, radix=after hist, trim=after scan, funnel=after scatter, sort=bt returned)"
  PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE timeout 60 python3 scripts/diag/select_phases.py --lengths 2048 4096 8192 16384 131072 2>&1 | tail -6
  PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE timeout 60 python3 scripts/diag/select_phases.py --ctas 1 --lengths 16384 65536 2>&1 | tail -3
done
cp /tmp/sel_tree.cu csrc/topk_select.cu
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=250 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_memory_gpu.py tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
grep -E "^== |passed|failed|verdict|PASS|FAIL" $OUT/check.txt | tail -8
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
OUT=$OUT/ab ROUNDS=2 AB_DIRS="head:.jitcache/v-head scan:.jitcache/v-scan tree:csrc" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A > $OUT/ab.txt 2>&1
OUT=$OUT/abf ROUNDS=2 AB_DIRS="head:.jitcache/v-head tree:csrc" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A --local-force 4,64 > $OUT/abf.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
python3 scripts/ab_local_table.py $OUT/abf > $OUT/abf_table.txt 2>&1
echo "== A/B unforced"; cat $OUT/ab_table.txt
echo "== A/B forced 4,64"; cat $OUT/abf_table.txt
tar czf $OUT/logs.tgz -C $OUT ab abf chk 2>/dev/null; rm -rf $OUT/ab $OUT/abf $OUT/chk
