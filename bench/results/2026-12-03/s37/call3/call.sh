#!/usr/bin/env bash
# session 37, call 3 (one GPU, ranks sharing it): the Output CUDA one-slot mutant again, now also against 2000 graph replays (call 2: it survived the 50-call test). Call 2 ran the GPU mutants of scripts/diag/mutants.py - one parity slot instead
# of two in the Query Triton kernel (the interpreter's sequential programs hide it from the CPU tests), the Query CUDA
# kernel and the Output CUDA plain kernel - against the GPU back-to-back tests that should kill them.
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
rm -rf /tmp/mut && mkdir -p /tmp/mut && tar --exclude=./.jitcache --exclude=./.git -cf - . | tar -xf - -C /tmp/mut
PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 timeout 540 python3 scripts/diag/mutants.py --tree /tmp/mut --gpu --no-baseline \
  --timeout 240 --only cuda.output --json $OUT/gpu_mutants.json 2>&1 | tee $OUT/gpu_mutants.txt
