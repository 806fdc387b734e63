#!/usr/bin/env bash
# The multi-GPU correctness suites and the main job at W ranks on fewer GPUs (one is enough): ranks share GPUs
# (PEERDCP_SHARED_GPU=1, rank r on GPU r % count). Correctness only, nothing is timed: the ranks' processes
# time-slice a GPU, so each peer wait lasts scheduler slices (~50-100 ms per exchange on one H200), the ranks never
# run at the same time (memory-ordering races between GPUs running together are not exercised here), torch
# symmetric memory refuses ranks on one GPU (the symm cases skip) and NCCL too (device collectives go through
# gloo, so a collective captured in a CUDA graph skips). Graph-replay tests run conftest.replays(n) replays.
# Measured on one H200 at W = 8: ~50 + 20 + 270 + 230 s.
# Usage: WORLD=8 bash scripts/shared_check.sh   (logs under $OUT, like scripts/gpu_check.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
W=${WORLD:-4}
export PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=$W
stage() { STAGE_TIMEOUT=$1 TEST_TIMEOUT=${TT:-90} bash scripts/gpu_check.sh "$2" 2>&1 | sed -n '/-------- summary/,$p'; }
stage 150 "tests-mt:tests/test_memory_gpu.py tests/test_topk_gpu.py"
stage 100 "run:--world $W --geometry deepseek-v3.2 --rows 1,8,64 --context 32768"
stage 300 "tests-output:tests/test_output_gpu.py"
stage 330 "tests-query:tests/test_query_gpu.py"
