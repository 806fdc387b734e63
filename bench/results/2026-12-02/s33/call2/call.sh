#!/usr/bin/env bash
# session 33, call 2 (one GPU): the JIT, Query and Output GPU suites with ranks sharing the GPU (W = 2) on HEAD (not
# run since 6960b2c's cuda_index helper in memory vmm/symm and the stream handle); select_ctas_sweep after session
# 32's bucket_top; A/B tree vs loop1 (call 1's loop variant in the one-CTA instances only: the cluster instances'
# PTX is the tree's) on normal / indexer / forced scores; select_dist on loop1; the memory + Top-K suites on loop1
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/abi $OUT/abf $OUT/sd
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-jit:tests/test_jit_gpu.py" "tests-query:tests/test_query_gpu.py" "tests-output:tests/test_output_gpu.py" > $OUT/check.txt 2>&1
grep -E "^tests|^run" $OUT/check.txt | tail -4
two="tree:csrc loop1:.jitcache/v-loop1"
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
for m in ab: abi:--local-scores=indexer abf:--local-force=4,64; do
  d=${m%%:*} x=${m#*:}
  OUT=$OUT/$d ROUNDS=2 AB_DIRS="$two" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A ${x/=/ } > $OUT/$d.txt 2>&1
  python3 scripts/ab_local_table.py $OUT/$d > $OUT/${d}_table.txt 2>&1
  echo "== A/B $d"; cat $OUT/${d}_table.txt
done
timeout 100 python3 scripts/diag/select_ctas_sweep.py > $OUT/ctas_sweep.txt 2>&1; echo "== ctas sweep rc=$?"; tail -22 $OUT/ctas_sweep.txt
OUT=$OUT/sd ROUNDS=1 AB_DIRS="loop1:.jitcache/v-loop1" GREP='^\|' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh scripts/diag/select_dist.py --rows 1 128 --lengths 2048 4096 16384 65536 131072 > $OUT/sd.txt 2>&1
cat $OUT/sd.txt
cp csrc/topk_select.cu /tmp/tree_select.cu && cp .jitcache/v-loop1/topk_select.cu csrc/
OUT=$OUT/chk1 PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=150 TEST_TIMEOUT=120 bash scripts/gpu_check.sh "tests-topk:tests/test_memory_gpu.py tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" > $OUT/check_loop1.txt 2>&1
cp /tmp/tree_select.cu csrc/topk_select.cu
grep -E "^tests|^run" $OUT/check_loop1.txt | tail -2
tar czf $OUT/logs.tgz -C $OUT ab abi abf sd chk chk1 2>/dev/null; rm -rf $OUT/ab $OUT/abi $OUT/abf $OUT/sd $OUT/chk $OUT/chk1 $OUT/ab.txt $OUT/abi.txt $OUT/abf.txt
