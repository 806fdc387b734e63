#!/usr/bin/env bash
# The peers' Python files for bench/peers (issue 54), extracted from their wheels into the git-ignored /.peers/.
# Never installed, never a runtime dependency: bench/peers loads single files with stand-ins for vLLM's runtime.
#
#   bash scripts/setup_peers.sh                      # pip download from PyPI (CI)
#   PEERDCP_WHEELS=/path bash scripts/setup_peers.sh  # offline, from a dir holding vllm-0.34.0-*.whl
#
# Idempotent: does nothing when the files are already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
VLLM_VERSION=0.34.0
DEST=${PEERDCP_PEERS:-.peers}
# dcp.py: the Output a2a/ag_rs; kernels.py: fused_q (the RoPE + FP8 query kernel); dcp_indexer_cutedsl.py and
# dcp_topk_direct.py: the Top-K candidate pack, the stable select (CuTeDSL) and the symmetric-memory push
FILES=(
  vllm/v1/attention/ops/dcp.py
  vllm/models/deepseek_v32/common/kernels.py
  vllm/model_executor/kernels/attention/dsa/dcp_indexer_cutedsl.py
  vllm/model_executor/kernels/attention/dsa/dcp_topk_direct.py
)
missing=0
for f in "${FILES[@]}"; do [ -f "$DEST/$f" ] || missing=1; done
if [ "$missing" = 0 ]; then
  echo "setup_peers: vllm $VLLM_VERSION files present in $DEST"
  exit 0
fi
wheels=${PEERDCP_WHEELS:-}
if [ -z "$wheels" ]; then
  wheels=$(mktemp -d)
  trap 'rm -rf "$wheels"' EXIT
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip download -q --no-deps "vllm==$VLLM_VERSION" -d "$wheels"
fi
whl=$(ls "$wheels"/vllm-"$VLLM_VERSION"-*.whl | head -1)
mkdir -p "$DEST"
"$PY" - "$whl" "$DEST" "${FILES[@]}" <<'PYEOF'
import sys, zipfile
whl, dest, files = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(whl) as z:
    for f in files:
        z.extract(f, dest)
PYEOF
echo "setup_peers: extracted ${#FILES[@]} vllm $VLLM_VERSION files into $DEST"
