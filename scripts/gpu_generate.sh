#!/usr/bin/env bash
# On one GPU (ranks sharing it, PEERDCP_SHARED_GPU=1): peerdcp generate at DeepSeek-V3.2's attention geometry
# (128 heads, 512 + 64, indexer 64 x 128, top-k 2048; 2 layers, small MoE) with a 4096-token context, and the
# peers' one-GPU checks. Logs and the JSON report go under $OUT; the summary is printed last.
#   bash scripts/gpu_generate.sh            (run from the repo root on the GPU machine; .peers/ carried)
set -uo pipefail
cd "$(dirname "$0")/.."
export PEERDCP_SHARED_GPU=${PEERDCP_SHARED_GPU:-1}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
STAGE_TIMEOUT=${STAGE_TIMEOUT:-420} bash scripts/gpu_check.sh env \
  "py-generate:-m peerdcp generate --size attention --family deepseek-v3.2 --world 2 --prompt-len 4096 --batch 2 --new-tokens 16 --chunk 256 --no-timing --json $OUT/generate.json" \
  "py-peers:-m bench.peers.gpu_check"
