#!/usr/bin/env bash
# README command 2: set up and run the tests (CPU tests everywhere; GPU tests run when CUDA is present).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
