#!/usr/bin/env bash
# session 41, call 5 (one GPU): the CPU suite (everything not marked cuda / multigpu) on a machine WITH a GPU, as a
# user running the README's test command there would: call 3 found two host-side tests that launched on the GPU;
# are there others?
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
timeout -s INT -k 20 400 python3 -m pytest -q -rfE -p no:cacheprovider --durations=5 --timeout=150 -m "not cuda and not multigpu" \
  tests > $OUT/cpu_suite_on_gpu.txt 2>&1
echo "cpu suite on a GPU machine rc=$?" >> $OUT/cpu_suite_on_gpu.txt; tail -25 $OUT/cpu_suite_on_gpu.txt | cut -c1-250
