#!/usr/bin/env bash
# session 41, call 2 (one GPU, ranks sharing it): the main job's new merge check (the merged output inside
# dcp_reduce_bounds of every rank's all-gathered partials) at W = 2 (DeepSeek-V3.2, GLM-5) and W = 8; the five
# Output tests at W = 8 that call 1's stage bound cut; the Query suite at W = 2 on session 40's final reference
# refactor (_table_rows), not yet run on the GPU.
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
export PEERDCP_SHARED_GPU=1
PEERDCP_GPU_WORLD=2 OUT=$OUT/chk STAGE_TIMEOUT=150 TEST_TIMEOUT=120 bash scripts/gpu_check.sh \
  "run:--world 2 --rows 1,8" "py-glm:-m peerdcp run --world 2 --geometry glm-5 --rows 1,3" \
  "py-w8:-m peerdcp run --world 8 --geometry deepseek-v3.2 --rows 1,8,64 --context 32768" \
  "tests-query:tests/test_query_gpu.py" > $OUT/check.txt 2>&1
sed -n '/-------- summary/,$p' $OUT/check.txt
grep -h -A6 "parity with the unsharded" $OUT/chk/run.log $OUT/chk/py-w8.log | head -30
PEERDCP_GPU_WORLD=8 timeout -s INT -k 15 170 python3 -m pytest -q -rf -p no:cacheprovider --durations=5 --timeout=120 \
  tests/test_output_gpu.py -k "(missing_peer and (chunked or sentinel or triton)) or create_close" > $OUT/output_w8_rest.txt 2>&1
echo "output W=8 rest rc=$?" >> $OUT/output_w8_rest.txt; tail -9 $OUT/output_w8_rest.txt | cut -c1-250
tar czf $OUT/logs.tgz -C $OUT chk; rm -rf $OUT/chk
