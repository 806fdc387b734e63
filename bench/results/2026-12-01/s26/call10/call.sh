set -u
source scripts/gpu_env.sh
export PEERDCP_CACHE=$PWD/.jitcache
OUT=${OUT:-$PWD/out}; mkdir -p $OUT
timeout 200 python3 -m pytest -q -x tests/test_topk_local_gpu.py > $OUT/tests-local.log 2>&1; echo "local tests rc=$?"; grep -E "passed|failed" $OUT/tests-local.log | tail -2
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
