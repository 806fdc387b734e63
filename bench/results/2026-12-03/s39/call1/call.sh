#!/usr/bin/env bash
# session 39, call 1 (one GPU; ranks share it for the multi-rank tests): the second GPU mutation round - 12
# cuda.merge / cuda.score mutants (csrc/topk_merge.cu, csrc/topk_score.cu) and 9 cuda.output / cuda.query mutants
# (output_direct.cu, query_direct.cu, two in query_common.cuh) - with the libraries prebuilt on the CPU machine
# (mutlibs.tar.xz, untracked: the clean libraries and every mutant tree's), after a baseline on the unmutated tree
# of every test they list plus this session's new tests (one-rank scans with int32 lengths, merge with 3 distinct
# scores, Query positions outside the table).
set -uo pipefail
source scripts/gpu_env.sh
export PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)" | tee -a $OUT/env.txt
python3 -c "import tarfile; tarfile.open('mutlibs.tar.xz').extractall('.jitcache')" && ls .jitcache | wc -l | tee $OUT/cache.txt
PICK="cuda.merge cuda.score cuda.output.plain cuda.query.raw cuda.query.units cuda.query.ll cuda.query.push cuda.query.pos"
SEL=$(python3 -c "
import sys; sys.path.insert(0, 'scripts/diag'); import mutants
pick = '$PICK'.split()
print(' '.join(dict.fromkeys(t for m in mutants.MUTANTS if m.gpu and any(m.name.startswith(p) for p in pick) for t in m.tests)))")
timeout 230 python3 -m pytest -q -rf $SEL tests/test_topk_merge_gpu.py \
  "tests/test_topk_local_gpu.py::test_gpu_scan_against_reference_on_one_rank" \
  "tests/test_query_gpu.py::test_gpu_byte_identical_all_paths[vmm]" "tests/test_topk_gpu.py::test_gpu_cuda_scan_against_reference" \
  --durations=8 > $OUT/baseline.txt 2>&1; echo "baseline rc=$?" >> $OUT/baseline.txt; tail -14 $OUT/baseline.txt
rm -rf /tmp/mut && mkdir -p /tmp/mut && tar --exclude=./.jitcache --exclude=./.git --exclude=./mutlibs.tar.xz -cf - . | tar -xf - -C /tmp/mut
timeout 340 python3 scripts/diag/mutants.py --tree /tmp/mut --gpu --no-baseline --timeout 120 --only $PICK \
  --json $OUT/gpu_mutants.json 2>&1 | cut -c1-400 | tee $OUT/gpu_mutants.txt
ls -d .jitcache/peerdcp_* | wc -l
