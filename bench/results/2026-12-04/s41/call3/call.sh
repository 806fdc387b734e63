#!/usr/bin/env bash
# session 41, call 3 (one GPU, ranks sharing it), two commands on one warm machine:
# (a) the Output opt-in CUDA variants at W = 2, ll_default, and two breakdown cases:
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
export PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2
timeout -s INT -k 15 420 python3 -m pytest -q -rf -p no:cacheprovider --durations=5 --timeout=150 \
  tests/test_output_variants.py -k "(opt_in and ll_default) or (breakdown and (8-None or 1-0))" > $OUT/variants_w2.txt 2>&1
# (b) the rest of the file (found the two host-side tests that launch with fake peer addresses):
timeout -s INT -k 15 300 python3 -m pytest -q -rf -p no:cacheprovider --durations=3 --timeout=150 tests/test_output_variants.py \
  -k "not ((opt_in and ll_default) or (breakdown and (8-None or 1-0)))" > $OUT/variants_rest_w2.txt 2>&1
