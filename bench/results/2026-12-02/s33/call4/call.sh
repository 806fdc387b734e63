#!/usr/bin/env bash
# session 33, call 4 (one GPU): the tree = sample_thresholds' outlier-robust range (8 groups of 4 lanes' sample minima /
# maxima: the largest group minimum to the smallest group maximum); memory + Top-K suites with ranks sharing the GPU
# (new cases: sinks, groups) and the main job; select_dist head vs tree incl. sinks; A/B head vs tree (normal, forced)
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/abi $OUT/abf $OUT/sd
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_memory_gpu.py tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
grep -E "^tests|^run|FAILED" $OUT/check.txt | tail -8
two="head:.jitcache/v-head tree:csrc"
OUT=$OUT/sd ROUNDS=1 AB_DIRS="$two" GREP='^\|' STAGE_TIMEOUT=120 bash scripts/ab_bench.sh scripts/diag/select_dist.py --rows 1 32 128 --lengths 16384 65536 131072 --kinds normal cauchy sink1000 sink-1e30 > $OUT/sd.txt 2>&1
cat $OUT/sd.txt
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
for m in ab: abf:--local-force=4,64; do
  d=${m%%:*} x=${m#*:}
  OUT=$OUT/$d ROUNDS=2 AB_DIRS="$two" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A ${x/=/ } > $OUT/$d.txt 2>&1
  python3 scripts/ab_local_table.py $OUT/$d > $OUT/${d}_table.txt 2>&1
  echo "== A/B $d"; cat $OUT/${d}_table.txt
done
tar czf $OUT/logs.tgz -C $OUT ab abi abf sd chk 2>/dev/null; rm -rf $OUT/ab $OUT/abi $OUT/abf $OUT/sd $OUT/chk $OUT/ab.txt $OUT/abi.txt $OUT/abf.txt
