#!/usr/bin/env bash
# Test-time SGLang for the peerdcp SGLang plugin's tests: the real sglang==0.5.23 wheel with --no-deps (it
# pins torch 2.14.1, FlashInfer, DeepGEMM, ...: none of that is installed), plus the few light packages
# listed below (LIGHT_PACKAGES) that its argument / plugin / DCP-communication modules import.
# Never a runtime dependency of peerdcp. Installs into the *active* python (setup.sh activates .venv first).
#
#   bash scripts/setup_sglang.sh                      # from PyPI (CI)
#   PEERDCP_WHEELS=/path bash scripts/setup_sglang.sh  # offline, from a wheel dir made by fetch_sglang_wheels.sh
#
# Idempotent: does nothing when sglang 0.5.23 and every needed module already import.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
SGLANG_VERSION=0.5.23
export PIP_DISABLE_PIP_VERSION_CHECK=1
# The packages SGLang 0.5.23 (installed with --no-deps) needs so that the plugin's tests can import
# sglang.srt.plugins, sglang.srt.server_args, sglang.srt.arg_groups.resolution_hooks,
# sglang.srt.layers.dcp.comm and sglang.srt.distributed.parallel_state (GroupCoordinator included: tvm-ffi).
# Found by importing those modules in a fresh venv (torch + triton only) until nothing was missing.
# None of them depends on torch. scripts/fetch_sglang_wheels.sh reads this list (--print-packages).
LIGHT_PACKAGES=(
  orjson
  psutil
  pybase64
  requests
  packaging
  pillow
  starlette
  msgspec
  pydantic
  pyzmq
  tqdm
  ipython
  aiohttp
  apache-tvm-ffi==0.1.11
)
if [ "${1:-}" = "--print-packages" ]; then
  printf '%s\n' "${LIGHT_PACKAGES[@]}"
  exit 0
fi

check() {
  "$PY" - "$SGLANG_VERSION" <<'PYEOF' 2>/dev/null
import importlib, sys, warnings
from importlib.metadata import version
warnings.simplefilter("ignore")
if version("sglang") != sys.argv[1]:
    sys.exit(1)
for m in ("sglang.srt.plugins", "sglang.srt.server_args", "sglang.srt.arg_groups.resolution_hooks",
          "sglang.srt.layers.dcp.comm", "sglang.srt.distributed.parallel_state", "tvm_ffi"):
    importlib.import_module(m)
PYEOF
}

if check; then
  echo "setup_sglang: sglang $SGLANG_VERSION and its test packages are present"
  exit 0
fi

pip_args=(-q)
if [ -n "${PEERDCP_WHEELS:-}" ]; then
  pip_args+=(--no-index --find-links "$PEERDCP_WHEELS")
fi
torch_before=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)

light=("${LIGHT_PACKAGES[@]}")
"$PY" -m pip install "${pip_args[@]}" "${light[@]}"
"$PY" -m pip install "${pip_args[@]}" --no-deps "sglang==$SGLANG_VERSION"

torch_after=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
if [ "$torch_before" != "$torch_after" ]; then
  echo "setup_sglang: torch changed from $torch_before to $torch_after -- this script must never touch torch" >&2
  exit 1
fi
if ! check; then
  echo "setup_sglang: sglang $SGLANG_VERSION installed but its modules do not import; run:" >&2
  echo "  $PY -c 'import sglang.srt.plugins, sglang.srt.server_args, sglang.srt.layers.dcp.comm'" >&2
  exit 1
fi
echo "setup_sglang: installed sglang $SGLANG_VERSION (--no-deps) and ${#light[@]} light packages"
