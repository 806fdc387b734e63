#!/usr/bin/env bash
# session 40, call 4 (one GPU, ranks sharing it): the Output GPU suite at W = 4 (W = 8 does not fit the budget left), last run there in
# session 20 (sessions 35-38 changed the Output code: int32 offsets of the a2a combine, the interpreter's bf16
# conversions, the collective paths' bounds); first the memory suite at W = 2 (PeerBuffer's alignment check is now
# agreed over the group: one more CPU collective per allocation).
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
export PEERDCP_SHARED_GPU=1
PEERDCP_GPU_WORLD=2 timeout 90 python3 -m pytest -q -rf -p no:cacheprovider tests/test_memory_gpu.py > $OUT/memory_w2.txt 2>&1
echo "memory W=2 rc=$?" >> $OUT/memory_w2.txt; tail -2 $OUT/memory_w2.txt
for W in 4; do
  [ $W = 4 ] && T=140 || T=270
  PEERDCP_GPU_WORLD=$W timeout -s INT -k 20 $T python3 -m pytest -q -rf -p no:cacheprovider --timeout=150 tests/test_output_gpu.py \
    --durations=3 > $OUT/output_w$W.txt 2>&1
  echo "output W=$W rc=$?" >> $OUT/output_w$W.txt; tail -7 $OUT/output_w$W.txt | cut -c1-250
done
