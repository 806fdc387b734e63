#!/usr/bin/env bash
# session 40, call 3 (one GPU, 8 ranks sharing it): the three Query tests call 2's stage ran out of time before
# (its 300 s bound; the 39 before them passed, both byte-identity matrices among them).
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
export PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=8
timeout 200 python3 -m pytest -q -rf -p no:cacheprovider --timeout=120 "tests/test_query_gpu.py::test_gpu_missing_peer_times_out[cuda_sn16]" \
  "tests/test_query_gpu.py::test_gpu_missing_peer_times_out[triton]" "tests/test_query_gpu.py::test_gpu_bad_inputs_and_auto" \
  --durations=3 > $OUT/query_w8_rest.txt 2>&1
echo "rc=$?" >> $OUT/query_w8_rest.txt; tail -8 $OUT/query_w8_rest.txt
