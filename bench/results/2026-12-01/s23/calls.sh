#!/usr/bin/env bash
# session 23 device call script (not committed)
set -u
cd "$(dirname "$0")"
OUT=${OUT:-$PWD/out}
MODE=${1:-1}
V='--variant cuda:scan_backend="cuda"'
if [ "$MODE" = 2 ]; then
  PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=120 PYTEST_EXTRA="-s" PYTEST_K="cuda_scan or scoring_kernel or precision" \
    bash scripts/gpu_check.sh "tests-cscan:tests/test_topk_gpu.py tests/test_s23_scratch.py"
  grep PREC $OUT/tests-cscan.log
  STAGE_TIMEOUT=330 bash scripts/gpu_check.sh "py-sweep:scripts/diag/score_sweep.py $OUT/sweep --emulate --world 2 --configs --rows 1 8 32 64 128 --rounds 1 --iters 20 $V --variant c21:scan_backend=\"cuda\";cuda_scan_min_ctas=1 --variant c26:scan_backend=\"cuda\";cuda_scan_min_ctas=6 --variant c36:scan_backend=\"cuda\";cuda_scan_stages=3;cuda_scan_min_ctas=6 --variant c41:scan_backend=\"cuda\";cuda_scan_stages=4;cuda_scan_min_ctas=1 --variant cs0:scan_backend=\"cuda\";cuda_scan_cta_pages=0.5 --variant cs6:scan_backend=\"cuda\";cuda_scan_cta_pages=6" | tail -5
  grep -E "^ *[0-9]+ +[0-9]+ " $OUT/py-sweep.log
fi
if [ "$MODE" = 3 ]; then
  C='scan_backend="cuda"'
  VS="$V"
  for n in 2 4 6 8 10; do VS="$VS --variant n$n:$C;cuda_scan_npage=$n"; done
  VS="$VS --variant c26:$C;cuda_scan_min_ctas=6 --variant c26n4:$C;cuda_scan_min_ctas=6;cuda_scan_npage=4 --variant c26n8:$C;cuda_scan_min_ctas=6;cuda_scan_npage=8"
  STAGE_TIMEOUT=250 bash scripts/gpu_check.sh "py-sweep:scripts/diag/score_sweep.py $OUT/sweep --emulate --world 2 --configs --rows 8 32 64 --rounds 2 --iters 20 $VS" >/dev/null
  grep -E "^ *[0-9]+ +[0-9]+ " $OUT/py-sweep.log
  STAGE_TIMEOUT=200 bash scripts/gpu_check.sh "py-glm:scripts/diag/score_sweep.py $OUT/glm --emulate --world 2 --heads 32 --configs --rows 1 8 32 128 --rounds 1 --iters 20 $V" >/dev/null
  grep -E "^ *[0-9]+ +[0-9]+ " $OUT/py-glm.log
fi
if [ "$MODE" = 4 ]; then
  C='scan_backend="cuda"'
  PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=120 PYTEST_K="cuda_scan or scoring_kernel" \
    bash scripts/gpu_check.sh "tests-cscan:tests/test_topk_gpu.py" | grep -E "^==|passed|failed"
  VS="--variant d01:$C;cuda_scan_stages=0;cuda_scan_min_ctas=1 --variant d06:$C;cuda_scan_stages=0;cuda_scan_min_ctas=6 --variant c21:$C;cuda_scan_stages=2;cuda_scan_min_ctas=1"
  STAGE_TIMEOUT=250 bash scripts/gpu_check.sh "py-sweep:scripts/diag/score_sweep.py $OUT/sweep --emulate --world 2 --configs --rows 1 8 32 64 128 --rounds 1 --iters 20 $VS" >/dev/null
  grep -E "^ *[0-9]+ +[0-9]+ " $OUT/py-sweep.log
  STAGE_TIMEOUT=200 bash scripts/gpu_check.sh "py-glm:scripts/diag/score_sweep.py $OUT/glm --emulate --world 2 --heads 32 --configs --rows 1 8 32 128 --rounds 1 --iters 20 $VS" >/dev/null
  grep -E "^ *[0-9]+ +[0-9]+ " $OUT/py-glm.log
fi
if [ "$MODE" = 6 ]; then
  PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=330 TEST_TIMEOUT=150 \
    bash scripts/gpu_check.sh "tests-topk:tests/test_topk_gpu.py tests/test_topk_merge_gpu.py tests/test_topk_local_gpu.py" "run:--world 2" | grep -E "^==|passed|failed|PASS|FAIL"
  VS='--variant triton:scan_backend="triton"'
  STAGE_TIMEOUT=200 bash scripts/gpu_check.sh "py-sweep:scripts/diag/score_sweep.py $OUT/sweep --emulate --world 2 --configs --rows 1 2 4 8 32 64 128 --rounds 2 --iters 20 $VS" >/dev/null
  grep -E "^ *[0-9]+ +[0-9]+ " $OUT/py-sweep.log
  STAGE_TIMEOUT=150 bash scripts/gpu_check.sh "py-glm:scripts/diag/score_sweep.py $OUT/glm --emulate --world 2 --heads 32 --configs --rows 1 2 4 8 32 128 --rounds 2 --iters 20 $VS" >/dev/null
  grep -E "^ *[0-9]+ +[0-9]+ " $OUT/py-glm.log
fi
if [ "$MODE" = 7 ]; then
  STAGE_TIMEOUT=150 PEERDCP_NVCC_EXTRA=-DPEERDCP_SCORE_TRACE bash scripts/gpu_check.sh "py-timeline:scripts/diag/scan_timeline.py --rows 1 4 8 32 128 --contexts 32768 131072 --csv $OUT/timeline" >/dev/null
  tail -22 $OUT/py-timeline.log
  source scripts/gpu_env.sh
  for b in triton cuda; do
    timeout 150 /usr/local/cuda/bin/ncu --target-processes all --kernel-name regex:"score_kernel|_logits_kernel" --launch-skip 10 --launch-count 1 \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
      python3 scripts/diag/scan_timeline.py --profile $b --rows 1 --contexts 32768 > $OUT/ncu_$b.txt 2>&1
    grep -E "Duration|Elapsed Cycles|Registers Per|Shared Memory Config|Achieved Occupancy|Warp Cycles Per Issued|Stall|Block Size|Grid Size|Dynamic Shared|Static Shared|One or More|No Eligible|Issued Warp" $OUT/ncu_$b.txt | head -30
  done
fi
if [ "$MODE" = 8 ]; then
  PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=120 PYTEST_K="cuda_scan" \
    bash scripts/gpu_check.sh "tests-cscan:tests/test_topk_gpu.py tests/test_topk_local_gpu.py" | grep -E "^==|passed|failed"
  VS='--variant triton:scan_backend="triton" --variant cuda:scan_backend="cuda"'
  STAGE_TIMEOUT=200 bash scripts/gpu_check.sh "py-sweep:scripts/diag/score_sweep.py $OUT/sweep --emulate --world 2 --configs --rows 1 2 4 8 32 --rounds 2 --iters 20 $VS" >/dev/null
  grep -E "^ *[0-9]+ +[0-9]+ " $OUT/py-sweep.log
  STAGE_TIMEOUT=150 bash scripts/gpu_check.sh "py-glm:scripts/diag/score_sweep.py $OUT/glm --emulate --world 2 --heads 32 --configs --rows 1 2 4 8 32 --rounds 1 --iters 20 $VS" >/dev/null
  grep -E "^ *[0-9]+ +[0-9]+ " $OUT/py-glm.log
  STAGE_TIMEOUT=100 PEERDCP_NVCC_EXTRA=-DPEERDCP_SCORE_TRACE bash scripts/gpu_check.sh "py-timeline:scripts/diag/scan_timeline.py --rows 4 8 32 --contexts 32768 131072" >/dev/null
  tail -7 $OUT/py-timeline.log
fi
if [ "$MODE" = 9 ]; then
  PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=120 PYTEST_K="cuda_scan" \
    bash scripts/gpu_check.sh "tests-cscan:tests/test_topk_gpu.py tests/test_topk_local_gpu.py" | grep -E "^==|passed|failed"
  C='scan_backend="cuda"'
  VS="--variant cuda:$C"
  for t in 0.1 0.2 0.3; do for n in 1 2 4; do VS="$VS --variant t${t}n$n:$C;cuda_scan_tail=$t;cuda_scan_tail_npage=$n"; done; done
  STAGE_TIMEOUT=250 bash scripts/gpu_check.sh "py-sweep:scripts/diag/score_sweep.py $OUT/sweep --emulate --world 2 --configs --rows 4 8 32 128 --rounds 1 --iters 20 $VS" >/dev/null
  grep -E "^ *[0-9]+ +[0-9]+ " $OUT/py-sweep.log
  STAGE_TIMEOUT=100 PEERDCP_NVCC_EXTRA=-DPEERDCP_SCORE_TRACE bash scripts/gpu_check.sh "py-timeline:scripts/diag/scan_timeline.py --rows 8 32 --contexts 32768 131072 --tail 0.2 --tail-npage 2" >/dev/null
  tail -9 $OUT/py-timeline.log
fi
if [ "$MODE" = 11 ]; then
  PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=200 TEST_TIMEOUT=120 PYTEST_K="cuda_scan" \
    bash scripts/gpu_check.sh "tests-cscan:tests/test_topk_gpu.py tests/test_topk_local_gpu.py" | grep -E "^==|passed|failed"
  C='scan_backend="cuda"'
  VS="--variant d06:$C --variant a15:$C;cuda_scan_stages=-1;cuda_scan_min_ctas=5 --variant a11:$C;cuda_scan_stages=-1;cuda_scan_min_ctas=1"
  STAGE_TIMEOUT=250 bash scripts/gpu_check.sh "py-sweep:scripts/diag/score_sweep.py $OUT/sweep --emulate --world 2 --configs --rows 1 4 8 32 128 --rounds 2 --iters 20 $VS" >/dev/null
  grep -E "^ *[0-9]+ +[0-9]+ " $OUT/py-sweep.log
  STAGE_TIMEOUT=100 PEERDCP_NVCC_EXTRA=-DPEERDCP_SCORE_TRACE bash scripts/gpu_check.sh "py-timeline:scripts/diag/scan_timeline.py --rows 8 32 --contexts 32768 131072 --instance -1 5" >/dev/null
  tail -9 $OUT/py-timeline.log
fi
