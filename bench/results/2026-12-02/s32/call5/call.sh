#!/usr/bin/env bash
# session 32, call 5: the committed selection (5848641) on the local-selection GPU tests, with the two long
# heavy-tailed cases added after call 2 (Cauchy 40K at W = 2, Pareto 128K)
set -uo pipefail
source scripts/gpu_env.sh
timeout 200 python3 -m pytest -q -x tests/test_topk_local_gpu.py 2>&1 | tail -4
