#!/usr/bin/env bash
# session 41, call 4 (one GPU, ranks sharing it): call 3b found two host-side tests (ll128 / sentinel bit per T)
# launching the Output kernel with fake peer addresses on a GPU machine (illegal address; every later test in the
# process errored). Now: current_stream_handle refuses non-CUDA devices, the tests check DirectLauncher._fill
# without a launch. Re-run the whole variants file at W = 2, and GPU tests of every ctypes launch path (Output
# CUDA kernels, Query CUDA paths, Top-K selection / merge / scan).
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
export PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2
PT="python3 -m pytest -q -rf -p no:cacheprovider --durations=3"
timeout -s INT -k 15 150 $PT --timeout=120 tests/test_output_variants.py tests/test_checks.py > $OUT/variants_w2.txt 2>&1
echo "variants W=2 rc=$?" >> $OUT/variants_w2.txt; tail -5 $OUT/variants_w2.txt | cut -c1-250
timeout -s INT -k 15 100 $PT --timeout=90 "tests/test_output_gpu.py::test_direct_agrees_with_reference[cuda-vmm]" "tests/test_output_gpu.py::test_direct_agrees_with_reference[cuda_ll128-vmm]" "tests/test_output_gpu.py::test_direct_agrees_with_reference[cuda_sentinel_only-vmm]" \
  "tests/test_query_gpu.py::test_gpu_byte_identical_cuda_paths[vmm]" "tests/test_query_gpu.py::test_gpu_back_to_back_eager[cuda]" > $OUT/launch_paths.txt 2>&1
echo "launch paths rc=$?" >> $OUT/launch_paths.txt; tail -5 $OUT/launch_paths.txt | cut -c1-250
timeout -s INT -k 15 170 $PT --timeout=120 tests/test_topk_local_gpu.py tests/test_topk_merge_gpu.py > $OUT/topk_one_gpu.txt 2>&1
echo "topk one-GPU rc=$?" >> $OUT/topk_one_gpu.txt; tail -5 $OUT/topk_one_gpu.txt | cut -c1-250
