#!/usr/bin/env bash
# Set up peerdcp from nothing: a virtual environment in .venv with torch, triton and peerdcp.
#   * with a CUDA GPU and a python3 that already has CUDA torch: the venv sees those system packages;
#   * otherwise: the CPU torch wheel (torch==2.13.0, never a multi-GB CUDA build) and triton 3.6.
# Usage: bash scripts/setup.sh [test]     ("test" adds pytest, hypothesis and ruff)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
[ "${1:-}" = "test" ] && extras="[test]"

has_cuda_torch() {
  command -v nvidia-smi >/dev/null 2>&1 && "$PY" -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

if [ ! -x .venv/bin/python ]; then
  if has_cuda_torch; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c 'import torch' 2>/dev/null; then
  python -m pip install -q torch==2.13.0
fi
if ! python -c 'import triton' 2>/dev/null; then
  python -m pip install -q triton==3.6.0
fi
python -m pip install -q -e ".${extras}"
# The transformers integration (peerdcp generate: the main job) and its CPU tests run against the oldest
# supported transformers (pure Python).
python -c 'import transformers' 2>/dev/null || python -m pip install -q 'transformers==5.17.0'
# ... and the newest supported one, beside it in the ignored /.tf-newest/ (tests/test_generate.py runs the main job
# with it on PYTHONPATH): transformers 5.25 and the four packages it needs newer than 5.17 does
if [ -n "$extras" ] && [ ! -d .tf-newest/transformers ]; then
  python -m pip install -q --no-deps --target .tf-newest transformers==5.25.0 huggingface-hub==2.4.0 httpx2==2.17.0 \
    httpcore2==2.17.0 tokenizers==0.23.3 truststore==0.10.5
fi
# The SGLang plugin's tests use the real sglang 0.5.23 package (no deps, plus the few light packages its
# argument module imports); it is a test-time package, never a runtime dependency.
if [ -n "$extras" ] && [ -f scripts/setup_sglang.sh ]; then
  bash scripts/setup_sglang.sh
fi
# bench/peers and tests/test_peers.py: vLLM 0.34.0's DCP file from its wheel into the ignored /.peers/ (one
# ~240 MB download; tests/test_peers.py skips with the reason when it is absent, so a failure here is not fatal).
if [ -n "$extras" ] && [ -f scripts/setup_peers.sh ]; then
  bash scripts/setup_peers.sh || echo "setup: scripts/setup_peers.sh failed; tests/test_peers.py will skip" >&2
fi
if python -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  python -c 'import cuda.bindings' 2>/dev/null || python -m pip install -q 'cuda-python>=12.6' || true
fi
