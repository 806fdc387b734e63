#!/usr/bin/env bash
# session 31, call 7: the local-selection GPU tests (with call 6's two new cases: I = 3, and I = 64 with forced windows,
# on rows of <= 4K local scores) on the committed selection code (call 6's gather_all change reverted)
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
timeout 100 python3 -m pytest -q tests/test_topk_local_gpu.py -p no:cacheprovider > $OUT/test_local.txt 2>&1
echo "== local tests rc=$?: $(tail -1 $OUT/test_local.txt)"
