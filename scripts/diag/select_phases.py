"""Where the CUDA local candidate selection's time goes (one GPU): phase stamps of CTA 0.

    PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE python3 scripts/diag/select_phases.py [--lengths 4096 16384 ...]
        [--ctas C] [--radix-only] [--kinds normal sink1e4 sink-1e30 ...] [--json]

Builds ``csrc/topk/select.cu`` with ``PEERDCP_SELECT_TRACE`` (a separate cache entry: the extra flag is part of
the key), runs ``ops.select`` on one row of random scores per local length (top 2048; ``--ctas``: CTAs per row,
0 = the library's rule; ``--kinds``: the score distributions of :func:`scores`, a fresh row per launch), and prints
the ``%globaltimer`` stamps of CTA 0's thread 0, in µs from the kernel's
start: after the samples' histogram (1), after the estimate's gathers (2), after the radix select (3, only when
the estimate failed), after the trim to the n largest gathered keys (6, only when the bucket pass overflowed),
after a cluster's CTAs moved their gathered keys into CTA 0 (7, ``funnel``), after the n largest are sorted and
stored (4), at the end (5); -1 = the phase did not run; the estimate's gather passes (``passes``: 1 when its
first threshold hit the window, 0 on rows of <= 4096 local scores) and ``bucket_top``'s retries by the keys' bits
(``retries``: 1 when its map by the scores overflowed).
The median of ``--reps`` launches; ``--json``: one JSON object per launch instead (what
``tests/test_topk_local_gpu.py`` checks the estimate's passes with). A diagnosis tool, not a benchmark.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


PHASES = ("sample", "estimate", "radix", "trim", "sort", "funnel", "end")
_WORDS = (1, 2, 3, 6, 4, 7, 5)  # g_trace's word of each phase


def scores(kind: str, T: int, L: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    """``[T, L]`` fp32 scores of one distribution: ``lognormal`` (sigma 1), ``cauchy``, ``sinkX`` (normal, local row
    0 scored X: one far outlier, always among the estimate's samples), else ``bench.topk._local_scores``'s
    (``normal``, ``indexer``)."""
    from bench.topk import _local_scores

    if kind == "lognormal":
        return torch.randn(T, L, generator=gen, device=dev).exp()
    if kind == "cauchy":
        return torch.tan(torch.pi * (torch.rand(T, L, generator=gen, device=dev) - 0.5))
    if kind.startswith("sink"):
        x = torch.randn(T, L, generator=gen, device=dev)
        x[:, 0] = float(kind[4:])
        return x
    return _local_scores(kind, T, L, gen, dev)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384, 65536, 131072])
    ap.add_argument("--kinds", nargs="+", default=["normal"], help="score distributions (see scores())")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--radix-only", action="store_true")
    ap.add_argument("--ctas", type=int, default=0, help="CTAs per row (0: the rule of policy.select_ctas)")
    ap.add_argument("--json", action="store_true", help="one JSON object per launch, no medians")
    a = ap.parse_args()
    if "-DPEERDCP_SELECT_TRACE" not in os.environ.get("PEERDCP_NVCC_EXTRA", ""):
        raise SystemExit("set PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE")
    from peerdcp.topk import ops
    from peerdcp.topk import policy as pol

    lib = ops.load()
    lib.peerdcp_topk_select_trace.argtypes = [ctypes.c_void_p]
    policy = dataclasses.replace(pol.DEFAULT_POLICY, select_radix_only=a.radix_only, select_ctas=a.ctas)
    dev = torch.device("cuda")
    if not a.json:
        print(f"{'length':>8} {'kind':>10} " + " ".join(f"{p:>8}" for p in PHASES) + "   passes retries")
    for L in a.lengths:
        for kind in a.kinds:
            gen = torch.Generator(device=dev).manual_seed(a.seed * 1000003 + L)
            lens = torch.full((1,), L, dtype=torch.int64, device=dev)
            out = torch.empty(1, min(2048, L), dtype=torch.int64, device=dev)
            rows = []
            for _ in range(a.reps):
                x = scores(kind, 1, L, gen, dev)
                buf = (ctypes.c_longlong * 10)()  # an older build without the counts leaves words 8-9 at 0
                ctas = pol.select_ctas(1, torch.cuda.current_device(), L, policy=policy)
                ops.select(
                    out, x, lens, rank=0, world_size=1, interleave=1, force_first=0, force_last=0, ctas=ctas,
                    radix_only=policy.select_radix_only,
                )  # fmt: skip
                torch.cuda.synchronize()
                if lib.peerdcp_topk_select_trace(buf) != 0:
                    raise SystemExit("peerdcp_topk_select_trace failed")
                t0 = buf[0]
                us = [(buf[i] - t0) / 1e3 if buf[i] >= t0 else -1.0 for i in _WORDS]
                rows.append(us + [buf[8], buf[9]])
                if a.json:
                    rec = {"length": L, "kind": kind, **dict(zip(PHASES, us)), "passes": buf[8], "retries": buf[9]}
                    print(json.dumps(rec))
            if not a.json:
                med = [statistics.median(r[i] for r in rows) for i in range(len(PHASES))]
                passes = "/".join(str(p) for p in sorted({int(r[-2]) for r in rows}))
                retries = f"{sum(int(r[-1]) for r in rows)}/{len(rows)}"
                print(f"{L:>8} {kind:>10} " + " ".join(f"{v:8.2f}" for v in med) + f"   {passes:>6} {retries:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
