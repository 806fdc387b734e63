"""Does the host's launch gap leak into the small-T Output timings? (GPU machine, W = 2)

    python3 scripts/diag/lead_compare.py OUT_DIR [--sglang-kernels PATH]

Runs ``python -m bench.output --quick`` at T = 1, 8, 32 twice, without (``--lead-us 0``, the harness up to
session 4) and with the GPU sleep before each timed replay (``--lead-us 100``), and prints p20 | median |
p80 per method for both. If the launch gap is the cause of the bimodal small-T numbers, the spread shrinks
with the lead and the medians fall to the fast mode, while T >= 32 and NCCL-based methods barely move.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--sglang-kernels", default=None)
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=2, help="runs per lead setting (alternating)")
    a = ap.parse_args()
    res: dict[tuple, list] = {}
    for rep in range(a.repeats):
        for lead in (0, 100):
            d = Path(a.out) / f"lead{lead}-r{rep}"
            cmd = [
                sys.executable, "-m", "bench.output", "--quick", "--kernels", "cuda", "cuda_nopdl", "--memories", "vmm",
                "--baselines", "a2a", "--tokens", *map(str, a.tokens), "--iters", "100", "--lead-us", str(lead),
                "--out", str(d),
            ]  # fmt: skip
            if a.sglang_kernels:
                cmd += ["--sglang-kernels", a.sglang_kernels]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
            if r.returncode != 0:
                print(f"lead {lead}: rc {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}", flush=True)
                continue
            for row in json.loads((d / "output.json").read_text())["rows"]:
                if row["mode"] == "graph":
                    res.setdefault((row["method"], row["T"], lead), []).append((row["p20"], row["median"], row["p80"]))
    print("\nOutput, Kimi, vmm, graph, slowest rank, µs: p20 | median | p80 per run; lead 0 vs lead 100 µs")
    methods = sorted({k[0] for k in res})
    for m in methods:
        for t in a.tokens:
            cells = []
            for lead in (0, 100):
                runs = res.get((m, t, lead), [])
                cells.append("  ".join(f"{p:5.2f}|{q:5.2f}|{r:5.2f}" for p, q, r in runs))
            print(f"{m:22} T={t:<4} lead0: {cells[0]:40}  lead100: {cells[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
