#!/usr/bin/env bash
# session 27, call 5: the estimate's gather stores each lane's taken keys in one loop round per key (was: a block
# per score position, run whenever any lane of the warp took that position) - local-selection GPU tests, an A/B
# against HEAD (fd00233) of the local selection, then the Top-K suites (ranks sharing the GPU) and the main job
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/ab
timeout 200 python3 -m pytest -q -x -m "cuda or multigpu" --timeout=150 -p no:cacheprovider tests/test_topk_local_gpu.py > $OUT/tests-local.txt 2>&1
tail -3 $OUT/tests-local.txt
OUT=$OUT/ab ROUNDS=2 AB_DIRS="head:.jitcache/v-head tree:csrc" GREP='^ +[0-9]+ +[0-9]+ ' STAGE_TIMEOUT=150 bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick --local-rows 1,8,32,64,128 > $OUT/ab.txt 2>&1
python3 scripts/ab_local_table.py $OUT/ab > $OUT/ab_table.txt 2>&1
PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
tar czf $OUT/logs.tgz -C $OUT ab 2>/dev/null; rm -rf $OUT/ab
echo "== A/B local selection (head = fd00233, tree = one round per taken key)"; cat $OUT/ab_table.txt
echo "== local tests"; tail -3 $OUT/tests-local.txt
echo "== check"; sed -n '/-------- summary/,$p' $OUT/check.txt
