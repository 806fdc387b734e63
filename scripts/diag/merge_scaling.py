"""The Top-K merge kernels' own work at W = 2, 4 and 8, on ONE GPU (no peers): what DCP4/DCP8 ask of them.

    python3 scripts/diag/merge_scaling.py OUT_DIR [--worlds 2 4 8] [--rows 1 8 32 128 512] [--ctas 1 2 4 8]

W sorted candidate lists of k = 2048 keys per row (every list full: the most work a merge can get) lie in local
memory, and each variant merges them into the exact top-k: ``cuda`` - the CUDA merge with the library's
rule (``peerdcp.topk.policy.grid``; ``rule`` pN: place-all mode, cN: cut-off mode, N CTAs per row), ``cN`` - the
cut-off mode forced to N CTAs per row, ``pN`` (``--place-all N ...``) - the place-all mode with N, ``triton`` - the
Triton merge, ``topk`` - ``torch.topk`` over the W·k gathered keys (the local half of the all-gather baseline).
Every variant's ids are checked equal to ``topk``'s. On the real path the merge reads the peers' lists over
NVLink and waits for their flags (bench/topk's ``merge_only`` at W GPUs); this measures the part that grows
with W on one SM per row, slow at W = 4 with one CTA placing W·k keys. µs per call: CUDA
graph, 20 calls per replay, median of 50 replays. A diagnosis tool, not a claim.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

K = 2048


def _lists(W: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """``[W, T, K]`` int64 canonical keys, unique, each row sorted descending (no -1 tail)."""
    N = W * T * K
    keys = (torch.randint(0, 1 << 31, (N,), generator=gen) << 31) | torch.randperm(N, generator=gen)
    return keys.view(W, T, K).sort(dim=2, descending=True).values


def _time(fn) -> float:
    """µs per call: median over the replays of bench.common.time_op (CUDA graph of 20 calls, 50 replays)."""
    from bench.common import time_op

    return statistics.median(time_op(fn, calls=20, iters=50))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--ctas", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--place-all", type=int, nargs="*", default=[], help="place_all variants pN: N CTAs per row")
    ap.add_argument("--waves", type=int, default=1, help="pN only where rows * N <= waves * SMs")
    a = ap.parse_args()
    from bench.common import run_ranks

    rows = run_ranks("scripts.diag.merge_scaling:rank_main", 1, vars(a))[0]  # one GPU, its own process group
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "merge_scaling.json").write_text(json.dumps(rows, indent=1))
    cols = ["W", "rows", "rule", "cuda"] + [f"c{c}" for c in a.ctas] + [f"p{c}" for c in a.place_all]
    cols += ["triton", "topk", "topk/cuda", "same"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---:|" * len(cols))
    for r in rows:
        cells = [r.get(c, "-") for c in cols]
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in cells) + " |")


def rank_main(args: dict) -> list[dict]:
    from peerdcp._runtime.device import num_sms
    from peerdcp.topk import ops
    from peerdcp.topk import policy as pol
    from peerdcp.topk.candidates import _merge_lists

    a = argparse.Namespace(**args)
    dev = torch.device("cuda", torch.cuda.current_device())
    assert ops.max_keys(dev.index) >= max(a.worlds) * K  # also opts the kernel in to the shared memory it needs
    rows = []
    for W in a.worlds:
        for T in a.rows:
            gen = torch.Generator().manual_seed(100 * W + T)
            sets = [_lists(W, T, gen).to(dev) for _ in range(2)]
            cands = [s.permute(1, 0, 2).reshape(T, W * K).contiguous() for s in sets]
            outs = [torch.empty(T, K, dtype=torch.int32, device=dev) for _ in range(2)]
            expect = [0x7FFFFFFF - (torch.topk(c, K, dim=1).values & 0x7FFFFFFF) for c in cands]

            def merge(impl: str, tuning: dict | None, i: int) -> None:
                policy = dataclasses.replace(pol.DEFAULT_POLICY, **(tuning or {}))
                _merge_lists(outs[i % 2], sets[i % 2], W, K, impl, policy=policy)

            variants = {"cuda": ("cuda", None), **{f"c{c}": ("cuda", {"cuda_merge_ctas_per_row": c}) for c in a.ctas}}
            for c in a.place_all:  # at most --waves CTAs per SM (rows * c <= waves * SMs)
                if T * c <= a.waves * num_sms(dev.index):
                    variants[f"p{c}"] = ("cuda", {"cuda_merge_place_all_ctas": c})
            variants["triton"] = ("triton", None)
            ctas, place_all = pol.grid(T, W, K, dev.index)
            row = {"W": W, "rows": T, "rule": f"{'p' if place_all else 'c'}{ctas}", "same": True}
            for name, (impl, tuning) in variants.items():
                for i in range(2):
                    outs[i].fill_(12345)  # poisoned: each variant must write every entry
                    merge(impl, tuning, i)
                    row["same"] &= bool(torch.equal(outs[i].long(), expect[i]))
                row[name] = _time(lambda i, impl=impl, tuning=tuning: merge(impl, tuning, i))
            row["topk"] = _time(lambda i: torch.topk(cands[i % 2], K, dim=1))
            row["topk/cuda"] = row["topk"] / row["cuda"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
