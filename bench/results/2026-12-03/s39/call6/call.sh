#!/usr/bin/env bash
# session 39, call 6 (one GPU, ranks sharing it): call 5 again after the review change (_slot_pointer takes the
# rank's base address: the own slot no longer loads the base a second time): the diagnosis and the Query GPU suite.
set -uo pipefail
source scripts/gpu_env.sh
export PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
timeout 150 python3 scripts/diag/query_mismatch.py 2>&1 | cut -c1-700 | tee $OUT/mismatch.txt | grep -c "bad=     0"
timeout 250 python3 -m pytest -q -rf tests/test_query_gpu.py --durations=3 > $OUT/query_w2.txt 2>&1
echo "query W=2 rc=$?" >> $OUT/query_w2.txt; tail -7 $OUT/query_w2.txt
