#!/usr/bin/env bash
# session 39, call 3 (one GPU, ranks sharing it): the Query matrix with the new rope_dim 512 out-of-table case at
# W = 2 and its mutant (cuda.query.pos.unstaged_not_clamped, prebuilt: mutlibs.tar.xz, untracked); then the
# W-dependent files of this session's new tests at W = 4 (Query suite: the oob cases through the W <= 4
# instantiations; the multi-rank Top-K suite: the CUDA scan owner-sharded at W = 4).
set -uo pipefail
source scripts/gpu_env.sh
export PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
python3 -c "import tarfile; tarfile.open('mutlibs.tar.xz').extractall('.jitcache')"; ls .jitcache | wc -l | tee $OUT/cache.txt
timeout 120 python3 -m pytest -q -rf "tests/test_query_gpu.py::test_gpu_byte_identical_cuda_paths[vmm]" \
  "tests/test_query_gpu.py::test_gpu_byte_identical_all_paths[vmm]" > $OUT/baseline.txt 2>&1
echo "baseline rc=$?" >> $OUT/baseline.txt; tail -4 $OUT/baseline.txt
rm -rf /tmp/mut && mkdir -p /tmp/mut && tar --exclude=./.jitcache --exclude=./.git --exclude=./mutlibs.tar.xz -cf - . | tar -xf - -C /tmp/mut
timeout 90 python3 scripts/diag/mutants.py --tree /tmp/mut --gpu --no-baseline --timeout 80 --only cuda.query.pos.unstaged \
  --json $OUT/gpu_mutant.json 2>&1 | cut -c1-400 | tee $OUT/gpu_mutant.txt
export PEERDCP_GPU_WORLD=4
timeout 170 python3 -m pytest -q -rf tests/test_query_gpu.py --durations=5 > $OUT/query_w4.txt 2>&1
echo "query W=4 rc=$?" >> $OUT/query_w4.txt; tail -9 $OUT/query_w4.txt
timeout 150 python3 -m pytest -q -rf tests/test_topk_gpu.py --durations=5 > $OUT/topk_w4.txt 2>&1
echo "topk W=4 rc=$?" >> $OUT/topk_w4.txt; tail -9 $OUT/topk_w4.txt
ls .jitcache | wc -l | tee -a $OUT/cache.txt
