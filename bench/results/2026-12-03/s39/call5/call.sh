#!/usr/bin/env bash
# session 39, call 5 (one GPU, ranks sharing it): the Query Triton kernel with its slot pointers declared 16-byte
# aligned (_slot_pointer): call 4's diagnosis again (now with each rank's own slot read back after a roped call),
# then the whole Query GPU suite at W = 2 (the rope512 out-of-table case among the matrix cases).
set -uo pipefail
source scripts/gpu_env.sh
export PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
python3 -c "import tarfile; tarfile.open('mutlibs.tar.xz').extractall('.jitcache')"
timeout 150 python3 scripts/diag/query_mismatch.py 2>&1 | cut -c1-700 | tee $OUT/mismatch.txt
timeout 250 python3 -m pytest -q -rf tests/test_query_gpu.py --durations=5 > $OUT/query_w2.txt 2>&1
echo "query W=2 rc=$?" >> $OUT/query_w2.txt; tail -9 $OUT/query_w2.txt
