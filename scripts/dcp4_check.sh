#!/usr/bin/env bash
# Issue 8 on nvidia-h200-x4 (or -x8 with WORLD=8), in parts of one device call each (the stage budgets are the
# durations measured at W = 4 plus a margin; W = 4 tests take 2-4x their W = 2 time):
#   PART=1 (~300 s): the W-dependent Query tests (sentinel push first), the main job, and short benchmarks of the
#          three mechanisms with their baselines in the same process;
#   PART=2 (~330 s): the memory, Output and Top-K W-dependent tests;
#   PART=3 (~300 s): the Query back-to-back eager test (200 calls; 281 s at W = 4);
#   PART=4 (~250 s): the Top-K merge's cut-offs and CTAs per row: its W-dependent tests and
#          bench.topk's merge part with every CTA count; bench.output at T <= 32 with the LL range, without
#          it and LL at every T (the W = 2 policy, LL to T = 8, is slow at T = 8 at W = 4);
#   PART=5 (<= 590 s): every test of the memory, Top-K and Output GPU suites (vmm and symm, the NCCL baselines in
#          graphs); PART=6 (<= 590 s): every Query GPU test. At W = 2 Top-K's 89 tests take 59 s and
#          memory 7 + JIT 1 + Query 60 + Output 60 take 431 s together; W = 4 may not fit one call each.
# Logs (and query.json) under $OUT, at most 8 files (the device returns no more).
# Usage: WORLD=4 PART=1 bash scripts/dcp4_check.sh   (WORLD=2 runs the same on nvidia-h200-x2)
set -uo pipefail
cd "$(dirname "$0")/.."
W=${WORLD:-4}
export PEERDCP_GPU_WORLD=$W  # every stage runs through gpu_check.sh, which sources scripts/gpu_env.sh
Q=tests/test_query_gpu.py
G="$Q::test_gpu_graph_10000_replays_changing_inputs"
QUERY="$G[vmm-cuda-push_sn] $G[vmm-cuda-push_sn16] $G[vmm-cuda-push_sn_whole] $G[symm-cuda-push_sn] $G[vmm-cuda-push]
 $G[vmm-cuda-push_plain] $G[vmm-cuda-raw] $G[vmm-cuda-exposed] $Q::test_gpu_graph_10000_replays_bf16_sentinel_push
 $Q::test_gpu_missing_peer_times_out[cuda_sn] $Q::test_gpu_byte_identical_cuda_paths[vmm]"
O=tests/test_output_gpu.py
T=tests/test_topk_gpu.py
OTHERS="tests/test_memory_gpu.py::test_gpu_write_read_every_peer $O::test_10000_graph_replays_with_changing_inputs[cuda-vmm]
 $O::test_direct_agrees_with_reference[cuda-vmm] $O::test_nccl_baselines_agree[a2a] $T::test_gpu_exact_selection_k2048[vmm-cuda]
 $T::test_gpu_cuda_graph_replays[1-direct-vmm-cuda] $T::test_gpu_cuda_graph_replays[64-direct-vmm-cuda]
 $T::test_gpu_sharded_pipeline_matches_replicated[vmm] $O::test_direct_agrees_with_reference[cuda-symm]
 $T::test_gpu_exact_selection_k2048[symm-cuda]"
stage() { STAGE_TIMEOUT=$1 TEST_TIMEOUT=${TT:-150} bash scripts/gpu_check.sh "$2" 2>&1 | sed -n '/-------- summary/,$p' | tail -n 3; }
case "${PART:-1}" in
  1)
    stage 20 env
    stage 230 "tests-query:$(echo $QUERY)"
    stage 60 "run:--world $W --geometry deepseek-v3.2 --rows 1,8,64 --context 32768"
    stage 45 "bench-query:--world $W --heads $((128 / (W > 4 ? W : 4))) --dtypes fp8 --modes graph --tokens 1 8 64 256 --iters 20 --variants direct-cuda-auto-vmm allgather-fused nccl-ag-only"
    stage 55 "bench-output:--world $W --geometries kimi dsv32 --tokens 1 8 64 256 --modes graph --memories vmm --kernels cuda --iters 20 --sglang-kernels .sglk/dcp_kernels.py"
    stage 60 "bench-topk:--world $W --quick"
    rm -f "${OUT:-out}"/*.png "${OUT:-out}"/run.json "${OUT:-out}"/output.json "${OUT:-out}"/topk.json
    for f in bench-query bench-output bench-topk; do echo "##### $f"; tail -n 14 "${OUT:-out}/$f.log"; done ;;
  2) stage 330 "tests-others:$(echo $OTHERS)" ;;
  3) PYTEST_EXTRA=-rP TT=290 stage 300 "tests-b2b:$Q::test_gpu_back_to_back_eager[cuda]" ;;
  4)
    TK="$T::test_gpu_exact_selection_k2048[vmm-cuda] $T::test_gpu_exact_selection_small_k[vmm-cuda]
     $T::test_gpu_cuda_graph_replays[1-direct-vmm-cuda] $T::test_gpu_cuda_graph_replays[64-direct-vmm-cuda]
     $T::test_gpu_cuda_graph_replays[1-direct-symm-cuda] $T::test_gpu_back_to_back_without_barrier[vmm-cuda]
     $T::test_gpu_missing_peer_times_out"
    stage 150 "tests-topk:$(echo $TK)"
    stage 60 "bench-topk:--world $W --no-indexer --breakdown --merge-ctas 1,2,4,8 --quick"
    stage 90 "bench-output:--world $W --geometries kimi dsv32 --tokens 1 2 4 8 12 16 32 --modes graph --memories vmm --kernels cuda cuda_no_ll cuda_ll --baselines a2a --iters 20 --sglang-kernels .sglk/dcp_kernels.py"
    rm -f "${OUT:-out}"/*.png
    for f in bench-topk bench-output; do echo "##### $f"; tail -n 24 "${OUT:-out}/$f.log"; done ;;
  5)
    stage 120 "tests-mt:tests/test_memory_gpu.py $T tests/test_topk_merge_gpu.py tests/test_topk_local_gpu.py"
    stage 460 "tests-output:$O" ;;
  6) stage 590 "tests-query:$Q" ;;
  *) echo "PART must be 1 to 6" >&2; exit 2 ;;
esac
