"""Tuning sweep of the fused CUDA Output kernel (GPU machine, W = 2): build-time unroll depths x grid size.

    python3 scripts/diag/output_tune.py OUT_DIR [--tokens 8 32 128 256] [--per-sm 1 2 4]

For every build setting (``PEERDCP_NVCC_EXTRA`` -D flags; prebuild them on the build machine with the same
variable so the GPU machine does not compile) and every ``TUNING["cuda_programs_per_sm"]``, one
``python -m bench.output --quick`` run of the default kernel (with PDL) and ``nopdl`` (vmm), with
peerdcp's a2a in the same process as the reference point. Prints one table (µs, CUDA graph, slowest rank,
median). A tuning tool, not a claim: the claims come from the full benchmark with SGLang's a2a in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

BUILDS = {  # name: PEERDCP_NVCC_EXTRA
    "p4c2": "",  # the default build (kPubUnroll 4, kCombUnroll 2)
    "p8c2": "-DPEERDCP_OUTPUT_PUB_UNROLL=8",
    "p4c4": "-DPEERDCP_OUTPUT_COMB_UNROLL=4",
    "p8c4": "-DPEERDCP_OUTPUT_PUB_UNROLL=8 -DPEERDCP_OUTPUT_COMB_UNROLL=4",
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", nargs="+", type=int, default=[8, 32, 128, 256])
    ap.add_argument("--per-sm", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--builds", nargs="+", default=list(BUILDS), choices=list(BUILDS))
    ap.add_argument("--prebuild", action="store_true", help="only build every setting (no GPU needed)")
    a = ap.parse_args()
    out = Path(a.out)
    table = []
    for b in a.builds:
        env = dict(os.environ, PEERDCP_NVCC_EXTRA=BUILDS[b])
        if a.prebuild:
            subprocess.run([sys.executable, "-m", "peerdcp.jit"], env=env, check=True)
            continue
        for n in a.per_sm:
            d = out / f"{b}-sm{n}"
            cmd = [
                sys.executable, "-m", "bench.output", "--quick", "--kernels", "cuda", "cuda_nopdl", "--memories", "vmm",
                "--baselines", "a2a", "--tokens", *map(str, a.tokens), "--tuning", f"cuda_programs_per_sm={n}",
                "--out", str(d),
            ]  # fmt: skip
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
            if r.returncode != 0:
                print(f"{b} sm{n}: rc {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}", flush=True)
                continue
            rows = json.loads((d / "output.json").read_text())["rows"]
            for m in ("direct-vmm-cuda", "direct-vmm-cuda_nopdl", "a2a"):
                med = {r["T"]: r["median"] for r in rows if r["method"] == m and r["mode"] == "graph"}
                ok = all(r["ok"] for r in rows if r["method"] == m)
                table.append((b, n, m, ok, [med.get(t) for t in a.tokens]))
            print(f"done {b} sm{n}", flush=True)
    if a.prebuild:
        return 0
    print(f"\nOutput tuning sweep (Kimi, vmm, graph, slowest rank, median µs); T = {a.tokens}")
    print(f"{'build':6} {'per_sm':6} {'method':22} {'ok':3} " + " ".join(f"{t:>7}" for t in a.tokens))
    for b, n, m, ok, v in table:
        cells = " ".join(f"{x:7.2f}" if x is not None else "      -" for x in v)
        print(f"{b:6} {n:6} {m:22} {'y' if ok else 'N':3} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
