#!/usr/bin/env bash
# On one GPU (ranks sharing it, PEERDCP_SHARED_GPU=1): peerdcp generate at DeepSeek-V3.2's attention geometry
# (128 heads, 512 + 64, indexer 64 x 128, top-k 2048; 2 layers, small MoE) with a 4096-token context, and the
# peers' one-GPU checks; then GLM-5 at the same geometry with the exact indexer, an FP8 query and interleave 2. Logs and the JSON report go under $OUT; the summary is printed last.
#   bash scripts/gpu_generate.sh            (run from the repo root on the GPU machine; .peers/ carried)
set -uo pipefail
cd "$(dirname "$0")/.."
export PEERDCP_SHARED_GPU=${PEERDCP_SHARED_GPU:-1}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
G="-m peerdcp generate --size attention --world 2 --prompt-len 4096 --new-tokens 16 --chunk 256 --no-timing"
STAGE_TIMEOUT=${STAGE_TIMEOUT:-300} bash scripts/gpu_check.sh env \
  "py-generate:$G --family deepseek-v3.2 --batch 2 --json $OUT/generate.json" \
  "py-generate-glm:$G --family glm-5 --batch 1 --indexer exact --query fp8 --interleave 2 --json $OUT/generate-glm.json" \
  "py-peers:-m bench.peers.gpu_check"
