#!/usr/bin/env bash
# session 38, call 3 (one GPU; call 2 again, with each failure's summary line): a mutation round of the CUDA local selection (csrc/topk_select.cu): 12 mutants
# (scripts/diag/mutants.py, cuda.select.*) against tests/test_topk_local_gpu.py, their libraries prebuilt on the
# CPU machine (mutlibs.tar.xz, untracked: the mutant trees' source hashes), and the file's new test
# test_gpu_select_rows_past_the_width_and_short_tied_rows on the unmutated kernel first.
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
python3 -c "import tarfile; tarfile.open('mutlibs.tar.xz').extractall('.jitcache')" && ls .jitcache | tee $OUT/cache.txt
# the baseline: every test a mutant lists, on the unmutated kernel (the new test among them), not stopping at a failure
SEL=$(python3 -c "
import sys; sys.path.insert(0, 'scripts/diag'); import mutants
print(' '.join(dict.fromkeys(t for m in mutants.MUTANTS if m.name.startswith('cuda.select') for t in m.tests)))")
timeout 170 python3 -m pytest -q $SEL tests/test_topk_local_gpu.py::test_gpu_select_rows_past_the_width_and_short_tied_rows \
  --durations=5 > $OUT/baseline.txt 2>&1; echo "baseline rc=$?" >> $OUT/baseline.txt; tail -4 $OUT/baseline.txt
rm -rf /tmp/mut && mkdir -p /tmp/mut && tar --exclude=./.jitcache --exclude=./.git --exclude=./mutlibs.tar.xz -cf - . | tar -xf - -C /tmp/mut
timeout 420 python3 scripts/diag/mutants.py --tree /tmp/mut --gpu --no-baseline --timeout 150 --only cuda.select \
  --json $OUT/gpu_mutants.json 2>&1 | tee $OUT/gpu_mutants.txt
ls -d .jitcache/peerdcp_topk-* | wc -l
