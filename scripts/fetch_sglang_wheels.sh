#!/usr/bin/env bash
# Download (on a machine with PyPI access) the sglang 0.5.23 wheel and the light packages that
# scripts/setup_sglang.sh lists (LIGHT_PACKAGES), with their dependencies, for CPython 3.12 on manylinux x86_64, into a
# wheel dir (default .whl/, git-ignored). Carry it to a machine without network and run
#   PEERDCP_WHEELS=$PWD/.whl bash scripts/setup_sglang.sh
# Torch is not downloaded (sglang is fetched with --no-deps; none of the light packages needs torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-.whl}
PYVER=${PEERDCP_WHEELS_PYTHON:-3.12}
mkdir -p "$OUT"
export PIP_DISABLE_PIP_VERSION_CHECK=1
target=(--only-binary=:all: --python-version "$PYVER" --implementation cp
        --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps "${target[@]}" -d "$OUT" sglang==0.5.23
mapfile -t light < <(bash scripts/setup_sglang.sh --print-packages)
"$PY" -m pip download -q "${target[@]}" -d "$OUT" "${light[@]}"
if ls "$OUT" | grep -qiE '^(torch|triton|nvidia)[-_]'; then
  echo "fetch_sglang_wheels: a torch/triton/nvidia wheel was pulled in; remove it from $OUT" >&2
  exit 1
fi
echo "fetch_sglang_wheels: $(ls "$OUT" | wc -l) wheels in $OUT"
