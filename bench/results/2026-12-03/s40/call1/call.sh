#!/usr/bin/env bash
# session 40, call 1 (one GPU, ranks sharing it, W = 2): after kernel_support.peer_pointer declares peer bases
# 16-byte aligned (PeerBuffer checks it): the memory, Query and Top-K GPU suites; the main job (its query check is
# now bytewise) on MLA and DSA geometries; then the Query suite at W = 4 with the fp64 check as a rounding bound.
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
export PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2
OUT=$OUT/chk STAGE_TIMEOUT=130 TEST_TIMEOUT=120 bash scripts/gpu_check.sh \
  "tests-mem:tests/test_memory_gpu.py" "tests-query:tests/test_query_gpu.py" \
  "tests-topk:tests/test_topk_gpu.py tests/test_topk_local_gpu.py tests/test_topk_merge_gpu.py" \
  "run:--world 2 --rows 1,8" "py-glm:-m peerdcp run --world 2 --geometry glm-5 --rows 1,3" > $OUT/check.txt 2>&1
sed -n '/-------- summary/,$p' $OUT/check.txt
export PEERDCP_GPU_WORLD=4
timeout 170 python3 -m pytest -q -rf -p no:cacheprovider tests/test_query_gpu.py --durations=3 > $OUT/query_w4.txt 2>&1
echo "query W=4 rc=$?" >> $OUT/query_w4.txt; tail -7 $OUT/query_w4.txt | cut -c1-300
tar czf $OUT/logs.tgz -C $OUT chk; rm -rf $OUT/chk
