#!/usr/bin/env bash
# session 30, call 5: TopK.select's eager host time, head selector.py vs the tree's (ops imported once at module
# level, the CUDA-selection check made once per publishing call), B A B A in separate processes, ranks sharing the
# GPU (host columns only), 8 rows and 1 row; then the Top-K GPU suites and the main job on the tree
set -uo pipefail
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
cp peerdcp/topk/selector.py /tmp/sel_tree.py
for r in 1 2; do
  for side in tree head; do
    if [ $side = head ]; then cp ab_selector_head.py peerdcp/topk/selector.py; else cp /tmp/sel_tree.py peerdcp/topk/selector.py; fi
    for T in 8 1; do
      PEERDCP_SHARED_GPU=1 timeout 100 python3 scripts/diag/topk_eager_profile.py --world 2 --rows $T --calls 300 > $OUT/eager_${side}${r}_T$T.txt 2>&1
      echo "== $side$r rows $T: $(grep '^rank' $OUT/eager_${side}${r}_T$T.txt | sed -E 's/ +(checks|alloc_out|publish_merge_parts|select_gpu|merge) [0-9.]+ us//g' | tr '\n' ' ')"
    done
  done
done
cp /tmp/sel_tree.py peerdcp/topk/selector.py
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
echo "== check"; grep -E "passed|failed|error|PASS|FAIL" $OUT/check.txt | tail -4
tar czf $OUT/logs.tgz -C $OUT chk $(cd $OUT && ls eager_*.txt) 2>/dev/null; rm -rf $OUT/chk
