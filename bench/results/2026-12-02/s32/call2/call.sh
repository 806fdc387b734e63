#!/usr/bin/env bash
# session 32, call 2: the tree = bucket_top<kByBits> (kMaxBucket 128; the map by the keys' bits a second instance,
# called only where the score map overflowed; scan_pairs): the memory + Top-K GPU suites with ranks sharing the GPU
# (W = 2) and the main job; select_dist on the tree; A/B of head / k128 (kMaxBucket 128 alone) / tree on normal and
# on indexer scores, and head / tree with forced tokens (4 + 64)
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/abi $OUT/abf
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=250 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_memory_gpu.py tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
grep -E "^== |passed|failed|verdict|PASS|FAIL" $OUT/check.txt | tail -8
timeout 100 python3 scripts/diag/select_dist.py --rows 1 128 > $OUT/select_dist.txt 2>&1; echo "== select_dist rc=$?"; tail -10 $OUT/select_dist.txt
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
three="head:.jitcache/v-head k128:.jitcache/v-k128 tree:csrc"
OUT=$OUT/ab ROUNDS=2 AB_DIRS="$three" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A > $OUT/ab.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
OUT=$OUT/abi ROUNDS=2 AB_DIRS="$three" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A --local-scores indexer > $OUT/abi.txt 2>&1
python3 scripts/ab_local_table.py $OUT/abi > $OUT/abi_table.txt 2>&1
OUT=$OUT/abf ROUNDS=2 AB_DIRS="head:.jitcache/v-head tree:csrc" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A --local-force 4,64 > $OUT/abf.txt 2>&1
python3 scripts/ab_local_table.py $OUT/abf > $OUT/abf_table.txt 2>&1
echo "== A/B normal"; cat $OUT/ab_table.txt; echo "== A/B indexer"; cat $OUT/abi_table.txt; echo "== A/B forced 4,64"; cat $OUT/abf_table.txt
tar czf $OUT/logs.tgz -C $OUT ab abi abf chk 2>/dev/null; rm -rf $OUT/ab $OUT/abi $OUT/abf $OUT/chk
