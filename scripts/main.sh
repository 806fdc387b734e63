#!/usr/bin/env bash
# README command 1: set up and run the main job: a transformers DSA model decoding with DCP through all three
# mechanisms, checked against the same model unsharded (peerdcp generate; peerdcp run times one layer).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/peerdcp generate "$@"
