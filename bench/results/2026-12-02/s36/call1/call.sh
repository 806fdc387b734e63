#!/usr/bin/env bash
# session 36, call 1 (one GPU): eager host time of TopK.select and the Query gather (ranks sharing the GPU: host
# columns only), then the memory + Top-K suites and the main job after the gloo-twin change.
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
for i in 1 2; do
  PEERDCP_SHARED_GPU=1 timeout 150 python3 scripts/diag/topk_eager_profile.py --world 2 --rows 8 --calls 200 > $OUT/topk_eager_$i.txt 2>&1
  echo "topk eager $i rc=$?"; grep -E "^rank" $OUT/topk_eager_$i.txt
done
PEERDCP_SHARED_GPU=1 timeout 150 python3 scripts/diag/query_eager_profile.py --calls 200 > $OUT/query_eager.txt 2>&1
echo "query eager rc=$?"; grep -E "^rank" $OUT/query_eager.txt | head -4
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=250 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-mem:tests/test_memory_gpu.py tests/test_jit_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
grep -E "^(tests|run)" $OUT/check.txt; tail -3 $OUT/chk/*.log 2>/dev/null | tail -12
tar czf $OUT/logs.tgz -C $OUT chk; rm -rf $OUT/chk
