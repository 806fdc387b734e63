set -u
source scripts/gpu_env.sh
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
ROUNDS=2 AB_DIRS="head:.jitcache/v-head tree:csrc" GREP='^ +[0-9]+ +[0-9]+ ' bash scripts/ab_bench.sh bench.topk --world 1 --no-merge --no-indexer --local --quick > $OUT/ab.txt 2>&1
python3 - <<'PY'
import re,glob,collections,os
out=os.environ.get("OUT","out")
d=collections.defaultdict(dict)
for f in sorted(glob.glob(f"{out}/ab-*.log")):
    name=os.path.basename(f)[3:-4]
    for line in open(f):
        m=re.match(r"^ +(\d+) +(\d+) +(\w+) +(\d+) +([\d.]+) +([\d.]+)",line)
        if m: d[(int(m[1]),int(m[2]))][name]=(float(m[5]),float(m[6]),m[3])
names=sorted({n for v in d.values() for n in v})
print("L rows "+" ".join(names)+"  (cuda / cuda_1cta)")
for k in sorted(d): print(k, " ".join(f"{d[k][n][0]:.2f}/{d[k][n][1]:.2f}{'' if d[k][n][2]=='True' else '!'}" for n in names))
PY
PEERDCP_SHARED_GPU=1 PEERDCP_GPU_WORLD=2 STAGE_TIMEOUT=300 TEST_TIMEOUT=150 bash scripts/gpu_check.sh "tests-topk:tests/test_topk_local_gpu.py tests/test_topk_gpu.py tests/test_topk_merge_gpu.py" "run:--world 2" > $OUT/check.txt 2>&1
grep -E "PASS|FAIL" $OUT/run.log | tail -1
echo "== tests"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests-topk.log | head -20
