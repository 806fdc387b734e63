#!/usr/bin/env bash
# README command 1: set up and run the main job (a DCP decode step through all three mechanisms).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/peerdcp run "$@"
