#!/usr/bin/env bash
# session 31, call 8 (run as the `run` command itself): the local selection's time by score distribution
source scripts/gpu_env.sh; timeout 100 python3 scripts/diag/select_dist.py --rows 1 128 2>&1 | tail -12
