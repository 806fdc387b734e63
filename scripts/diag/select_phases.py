"""Where the CUDA local candidate selection's time goes (one GPU): phase stamps of CTA 0.

    PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE python3 scripts/diag/select_phases.py [--lengths 4096 16384 ...]
        [--ctas C] [--radix-only]

Builds ``csrc/topk_select.cu`` with ``PEERDCP_SELECT_TRACE`` (a separate cache entry: the extra flag is part of
the key), runs ``ops.select`` on one row of random scores per local length (top 2048; ``--ctas``: CTAs per row,
0 = the library's rule), and prints the ``%globaltimer`` stamps of CTA 0's thread 0, in µs from the kernel's
start: after the samples' histogram (1), after the estimate's gathers (2), after the radix select (3, only when
the estimate failed), after the trim to the n largest gathered keys (6, only when the bucket pass overflowed),
after a cluster's CTAs moved their gathered keys into CTA 0 (7, ``funnel``), after the n largest are sorted and
stored (4), at the end (5); -1 = the phase did not run.
The median of ``--reps`` launches. A diagnosis tool, not a benchmark.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384, 65536, 131072])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--radix-only", action="store_true")
    ap.add_argument("--ctas", type=int, default=0, help="CTAs per row (0: the rule of ops.select_ctas)")
    a = ap.parse_args()
    if "-DPEERDCP_SELECT_TRACE" not in os.environ.get("PEERDCP_NVCC_EXTRA", ""):
        raise SystemExit("set PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE")
    from peerdcp.topk import ops

    lib = ops.load()
    lib.peerdcp_topk_select_trace.argtypes = [ctypes.c_void_p]
    ops.TUNING["select_radix_only"] = a.radix_only
    ops.TUNING["select_ctas"] = a.ctas
    buf = (ctypes.c_longlong * 8)()
    phases = ("sample", "estimate", "radix", "trim", "sort", "funnel", "end")
    print(f"{'length':>8} " + " ".join(f"{p:>8}" for p in phases))
    for L in a.lengths:
        x = torch.randn(1, L, device="cuda")
        lens = torch.full((1,), L, dtype=torch.int64, device="cuda")
        out = torch.empty(1, min(2048, L), dtype=torch.int64, device="cuda")
        rows = []
        for _ in range(a.reps):
            x.normal_()
            ops.select(out, x, lens, rank=0, world_size=1, interleave=1, force_first=0, force_last=0)
            torch.cuda.synchronize()
            lib.peerdcp_topk_select_trace(buf)
            t0 = buf[0]
            rows.append([(buf[i] - t0) / 1e3 if buf[i] >= t0 else -1.0 for i in (1, 2, 3, 6, 4, 7, 5)])
        med = [statistics.median(r[i] for r in rows) for i in range(7)]
        print(f"{L:>8} " + " ".join(f"{v:8.2f}" for v in med))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
