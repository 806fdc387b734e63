#!/usr/bin/env bash
# session 34, call 1 (one GPU): the estimate's speed guard (tests/test_topk_local_gpu.py, new trace-build test) on
# the tree and on a3fe001's kernel (before the outlier-robust range: the test must fail there), and the phase /
# pass tables of both kernels (select_phases.py, trace builds prebuilt in .jitcache)
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT/chk
OUT=$OUT/chk STAGE_TIMEOUT=300 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-local:tests/test_topk_local_gpu.py"
ph() { PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE timeout 120 python3 scripts/diag/select_phases.py --lengths 16384 65536 131072 --kinds normal sink1000 sink1e4 sink-1e30 cauchy "$@"; }
{ echo "== tree, rule"; ph; echo "== tree, ctas 1"; ph --ctas 1; } > $OUT/phases.txt 2>&1
cp csrc/topk_select.cu /tmp/tree_select.cu
cp .jitcache/v-head/topk_select.cu csrc/topk_select.cu
timeout 200 python3 -m pytest -q -rfE --tb=line -p no:cacheprovider -m cuda -k estimate_ignores tests/test_topk_local_gpu.py > $OUT/old_test.log 2>&1; echo "old kernel pytest rc=$?" >> $OUT/old_test.log
{ echo "== a3fe001, rule"; ph; echo "== a3fe001, ctas 1"; ph --ctas 1; } >> $OUT/phases.txt 2>&1
cp /tmp/tree_select.cu csrc/topk_select.cu
tail -n 25 $OUT/chk/tests-local.log | grep -E "passed|failed|FAILED|ERROR" ; tail -n 15 $OUT/old_test.log; cat $OUT/phases.txt
