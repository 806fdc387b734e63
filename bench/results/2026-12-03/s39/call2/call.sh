#!/usr/bin/env bash
# session 39, call 2 (one GPU, ranks sharing it at W = 2): the whole files this session's new tests live in, on the
# final tree: Top-K (multi-rank, local, merge) and Query.
set -uo pipefail
source scripts/gpu_env.sh
export PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
python3 -c "import tarfile; tarfile.open('mutlibs.tar.xz').extractall('.jitcache')"
timeout 480 python3 -m pytest -q -rf tests/test_topk_gpu.py tests/test_topk_local_gpu.py tests/test_topk_merge_gpu.py \
  tests/test_query_gpu.py --durations=10 > $OUT/suites.txt 2>&1; echo "suites rc=$?" >> $OUT/suites.txt
tail -16 $OUT/suites.txt
