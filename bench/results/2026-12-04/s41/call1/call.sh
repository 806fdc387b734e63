#!/usr/bin/env bash
# session 41, call 1 (one GPU, ranks sharing it): the Output GPU suites after the check became the fp32 error-model
# bound (tests/rankfns_output: check_result / graph_replays / cuda_triton_twins / breakdown_then_full now use
# peerdcp.output.reference.dcp_reduce_bounds instead of one rounding + 1e-5 / the LSE's 1e-4 / Frobenius 4e-3):
# W = 2 (whole file + two breakdown cases), the approximate instructions the Output kernels really use (Triton
# PTX, CUDA SASS), then W = 8 (never run since session 20).
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
export PEERDCP_SHARED_GPU=1
PT="python3 -m pytest -q -rf -p no:cacheprovider --durations=3"
PEERDCP_GPU_WORLD=2 timeout -s INT -k 15 150 $PT --timeout=120 tests/test_output_gpu.py > $OUT/output_w2.txt 2>&1
echo "output W=2 rc=$?" >> $OUT/output_w2.txt; tail -6 $OUT/output_w2.txt | cut -c1-250
PEERDCP_GPU_WORLD=2 timeout -s INT -k 15 80 $PT --timeout=60 tests/test_output_variants.py -k "breakdown and (1-None or 128-0)" > $OUT/variants_w2.txt 2>&1
echo "variants W=2 rc=$?" >> $OUT/variants_w2.txt; tail -4 $OUT/variants_w2.txt | cut -c1-250
{
  echo "== Triton PTX of the Output kernels (approximate exp / log / division)"
  for f in $(grep -l -E "direct_kernel|combine_kernel|correct_kernel" ~/.triton/cache/*/*.ptx 2>/dev/null); do
    echo "$(basename $f): $(grep -o -E '(ex2|lg2|rcp|div)\.[a-z0-9.]+' $f | sort | uniq -c | tr '\n' ' ')"
  done
  echo "== CUDA Output library SASS (MUFU = the special-function unit)"
  for so in $(ls .jitcache/*/*output* 2>/dev/null | grep '\.so$'); do
    echo "$so: $(cuobjdump -sass $so 2>/dev/null | grep -o -E 'MUFU\.[A-Z0-9]+' | sort | uniq -c | tr '\n' ' ')"
  done
} > $OUT/instructions.txt 2>&1; cat $OUT/instructions.txt | cut -c1-300 | head -20
PEERDCP_GPU_WORLD=8 timeout -s INT -k 15 290 $PT --timeout=200 tests/test_output_gpu.py > $OUT/output_w8.txt 2>&1
echo "output W=8 rc=$?" >> $OUT/output_w8.txt; tail -8 $OUT/output_w8.txt | cut -c1-250
