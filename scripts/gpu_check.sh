#!/usr/bin/env bash
# Run on the lent GPU machine (no network): the GPU tests, benchmarks and main job, logs under $OUT.
# Usage: bash scripts/gpu_check.sh STAGE...   stages: env probe tests[-NAME][:PATHS] py[-NAME]:SCRIPT bench-output bench-query
#        bench-topk run    (each stage's log goes to $OUT/<stage>.log; a summary is printed last)
# PYTEST_EXTRA: more pytest words (split on spaces); PYTEST_K: a -k expression (may hold spaces: "not graph").
# Every stage is bounded (STAGE_TIMEOUT seconds, default 240) and every test by pytest-timeout, so one
# hung test costs minutes of the lease, not the whole call; the failing tests' names are in the summary.
# A test stage that runs out of time gets SIGINT first, so pytest still prints its failures so far.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
summary=()
ST=${STAGE_TIMEOUT:-240}
for stage in "$@"; do
  name=${stage%%:*}; arg=${stage#*:}; [ "$arg" = "$stage" ] && arg=""
  log="$OUT/${name}.log"
  t0=$(date +%s)
  case "$name" in
    env)
      { date -u; nvidia-smi; nvidia-smi topo -m; python3 -c 'import torch,triton,sys; print(sys.version); print("torch",torch.__version__,"cuda",torch.version.cuda,"triton",triton.__version__, "gpus",torch.cuda.device_count())';
        python3 -m pip list 2>/dev/null | grep -i -E "cuda-bindings|nccl|sglang|flashinfer"; } >"$log" 2>&1 ;;
    probe) timeout "$ST" python3 -m peerdcp probe >"$log" 2>&1 ;;
    tests*) timeout -s INT -k 45 "$ST" python3 -m pytest -v -rfE --tb=short --durations=8 ${PYTEST_EXTRA:-} ${PYTEST_K:+-k "$PYTEST_K"} --timeout=${TEST_TIMEOUT:-90} -p no:cacheprovider -m "cuda or multigpu or nvcc" \
             ${arg:-tests} >"$log" 2>&1 ;;
    bench-output) timeout "$ST" python3 -m bench.output --out "$OUT" ${arg:+$arg} >"$log" 2>&1 ;;
    bench-query) timeout "$ST" python3 -m bench.query --out "$OUT" ${arg:+$arg} >"$log" 2>&1 ;;
    bench-topk) timeout "$ST" python3 -m bench.topk --out "$OUT" ${arg:+$arg} >"$log" 2>&1 ;;
    py*) timeout "$ST" python3 $arg >"$log" 2>&1 ;;
    run) timeout "$ST" python3 -m peerdcp run ${arg:+$arg} --json "$OUT/run.json" >"$log" 2>&1 ;;
    *) echo "unknown stage $name" >"$log"; false ;;
  esac
  rc=$?
  summary+=("$(printf '%-14s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(tail -n 1 "$log" | cut -c1-90)")")
  [[ "$name" == tests* ]] && summary+=("$(grep -E '^(FAILED|ERROR) ' "$log" | cut -c1-120)")
done
for s in "${summary[@]}"; do
  echo "== ${s%%  *}"
done
echo "-------- tails --------"
for stage in "$@"; do
  name=${stage%%:*}
  echo "##### $name"; tail -n 25 "$OUT/${name}.log"
done
echo "-------- summary --------"
printf '%s\n' "${summary[@]}"
