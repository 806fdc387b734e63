#!/usr/bin/env bash
# session 30, call 1: one local_length helper in common.cuh (the Top-K selection and the indexer scan), the merge's
# grid computed once in TopK.select: Top-K GPU suites + the main job with ranks sharing the GPU (W = 2); head vs
# tree A/B of the local selection (unforced) and of the scan (score_sweep, one-GPU emulation of W = 2)
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab $OUT/chk $OUT/ss
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
echo "== check"; grep -E "passed|failed|error|PASS|FAIL" $OUT/check.txt | tail -8
B="head:.jitcache/v-head tree:csrc"
A="--world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,128 --local-lengths 2048,4096,16384,65536,131072"
OUT=$OUT/ab ROUNDS=2 AB_DIRS="$B" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=100 bash scripts/ab_bench.sh bench.topk $A > $OUT/ab.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
echo "== A/B local unforced"; cat $OUT/ab_table.txt
OUT=$OUT/ss ROUNDS=1 AB_DIRS="$B" GREP='^ *(ctx|[0-9])' STAGE_TIMEOUT=110 bash scripts/ab_bench.sh scripts/diag/score_sweep.py /tmp/ssout --emulate --world 2 --heads 64 --rows 1 8 32 --contexts 32768 131072 --configs --variant 'cuda:scan_backend="cuda"' --rounds 2 > $OUT/ss.txt 2>&1
echo "== A/B scan"; cat $OUT/ss.txt
gzip -9 $OUT/chk/tests-topk.log; cp $OUT/chk/tests-topk.log.gz $OUT/chk/run.json $OUT/ 2>/dev/null
tar czf $OUT/logs.tgz -C $OUT ab chk ss 2>/dev/null; rm -rf $OUT/ab $OUT/chk $OUT/ss
echo "== check tail"; tail -6 $OUT/check.txt
