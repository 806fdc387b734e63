#!/usr/bin/env bash
# session 35, call 3 (one GPU): the main job after peerdcp run's argument checks (positive ints, heads % world up
# front), ranks sharing the GPU (W = 2), and its usage errors on this machine.
set -uo pipefail
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
OUT=$OUT/chk PEERDCP_SHARED_GPU=1 STAGE_TIMEOUT=200 bash scripts/gpu_check.sh "run:--world 2 --rows 1,8" > $OUT/check.txt 2>&1
grep -E "^run" $OUT/check.txt
for a in "--rows 0" "--world 3" "--reps -1"; do PEERDCP_SHARED_GPU=1 python3 -m peerdcp run $a > $OUT/u.txt 2>&1; echo "run $a -> rc=$? $(tail -1 $OUT/u.txt)"; done
tar czf $OUT/logs.tgz -C $OUT chk; rm -rf $OUT/chk
