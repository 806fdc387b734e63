"""Where a CUDA indexer scan's time goes (one GPU): per-CTA start / first-keys / end stamps of one launch.

    PEERDCP_NVCC_EXTRA=-DPEERDCP_SCORE_TRACE python3 scripts/diag/scan_timeline.py [--rows 8 32] [--contexts 32768
        131072] [--heads 64] [--world 2] [--calls 20]

Builds ``csrc/topk_score.cu`` with ``PEERDCP_SCORE_TRACE`` (its own cache entry: the extra flag is part of the key),
makes the cases of ``bench.topk.indexer_case`` as rank 0 of an emulated ``--world`` group (``score_sweep.py
--emulate``), runs ``--calls`` scans of each layout back to back (the benchmark's chain) and reads the ``%globaltimer``
stamps of the last one: every CTA's start, the moment its first page's key bytes are in registers, and its end. Prints,
in µs from the first CTA's start: the span (last end), the spread of the starts, the first-keys latency (median, p90,
max over CTAs), the CTA durations, and the ends' quantiles (p10 / p50 / p90 / max: how long the last CTAs keep the
GPU after most are done). ``--csv DIR`` writes each launch's stamps. ``--profile BACKEND`` (any build) only runs
``--calls`` owner-sharded scans per case with ``TUNING["scan_backend"]`` = BACKEND, for a profiler:
``ncu --target-processes all --kernel-name regex:"score_kernel|_logits_kernel" --launch-skip 10 --launch-count 1
python3 scripts/diag/scan_timeline.py --profile cuda --rows 1``. A diagnosis tool, not a benchmark.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _q(xs: list[float], f: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(f * len(xs)))]


def rank_main(cfg: dict) -> list[str]:
    from bench.topk import indexer_case
    from peerdcp.kernel_support import num_sms
    from peerdcp.topk import cache as cache_mod
    from peerdcp.topk import indexer_logits, ops
    from peerdcp.topk import reference as ref
    from scripts.diag.score_sweep import _emulate_group

    W = cfg["world"]
    _emulate_group(W)
    cache_mod.TUNING.update(cfg["tune"])
    dev = torch.device("cuda", torch.cuda.current_device())
    lib = ops.load_score()
    if not cfg["profile"]:
        lib.peerdcp_topk_score_trace.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lines = [
        f"{'ctx':>7} {'rows':>4} {'layout':>13} {'pages x ctas':>8} {'span':>7} {'starts':>7} {'first50':>7} "
        f"{'first90':>7} {'firstmx':>7} {'dur50':>7} {'end10':>7} {'end50':>7} {'end90':>7} {'endmax':>7}"
    ]
    for ctx in cfg["contexts"]:
        for T in cfg["rows"]:
            gen = torch.Generator(device=dev).manual_seed(ctx + T)
            caches, q, w, lens, nsets = indexer_case(ctx, T, cfg["heads"], W, gen, dev)
            for lay in ("owner_sharded",) if cfg["profile"] else ("replicated", "owner_sharded"):
                c, tabs, _ = caches[lay]
                with mock.patch.dict(cache_mod.TUNING, {"scan_backend": cfg["profile"] or "auto"}):
                    for i in range(cfg["calls"]):
                        j = i % nsets
                        indexer_logits(q[j], w[j], c, lens, block_table=tabs[j], max_seq_len=ctx)
                torch.cuda.synchronize()
                if cfg["profile"]:
                    continue
                # the launch's grid, as indexer_logits computes it
                L = ref.local_length(ctx, 0, W, c.interleave) if c.sharded else ctx
                pages = -(-L // c.page_size)
                tune = cache_mod.TUNING
                slots = ops.score_resident(dev.index, tune["cuda_scan_min_ctas"], cfg["heads"]) * num_sms(dev.index)
                npage = tune["cuda_scan_npage"] or cache_mod._cuda_scan_npage(
                    T, pages, slots, tune["cuda_scan_cta_pages"]
                )
                ctas = T * -(-pages // npage)
                if ctas > 16384:
                    raise SystemExit(f"{ctas} CTAs: more than the trace holds")
                buf = (ctypes.c_ulonglong * (3 * ctas))()
                if lib.peerdcp_topk_score_trace(buf, ctas) != 0:
                    raise RuntimeError("trace copy failed")
                rows = [(buf[3 * b], buf[3 * b + 1], buf[3 * b + 2]) for b in range(ctas)]
                t0 = min(r[0] for r in rows)
                starts = [(r[0] - t0) / 1e3 for r in rows]
                first = [(r[1] - r[0]) / 1e3 for r in rows if r[1] >= r[0]]
                dur = [(r[2] - r[0]) / 1e3 for r in rows]
                ends = [(r[2] - t0) / 1e3 for r in rows]
                lines.append(
                    f"{ctx:>7} {T:>4} {lay:>13} {npage:>2}x{len(rows):<5} {max(ends):7.2f} {max(starts):7.2f} "
                    f"{statistics.median(first) if first else -1:7.2f} {_q(first, 0.9) if first else -1:7.2f} "
                    f"{max(first) if first else -1:7.2f} {statistics.median(dur):7.2f} {_q(ends, 0.1):7.2f} "
                    f"{statistics.median(ends):7.2f} {_q(ends, 0.9):7.2f} {max(ends):7.2f}"
                )
                print(lines[-1], flush=True)
                if cfg["csv"]:
                    out = Path(cfg["csv"])
                    out.mkdir(parents=True, exist_ok=True)
                    (out / f"{ctx}_{T}_{lay}.csv").write_text(
                        "start_ns,first_ns,end_ns\n" + "".join(f"{a - t0},{b - t0},{e - t0}\n" for a, b, e in rows)
                    )
            for c, _, _ in caches.values():
                c.close()
            torch.cuda.empty_cache()
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--contexts", nargs="+", type=int, default=[32768, 131072])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--csv", default="")
    ap.add_argument("--profile", default="", choices=["", "triton", "cuda"])
    ap.add_argument("--npage", type=int, default=None, help="TUNING['cuda_scan_npage'] (default: the library's)")
    ap.add_argument("--min-ctas", type=int, default=None, help="TUNING['cuda_scan_min_ctas']")
    a = ap.parse_args()
    if not a.profile and "-DPEERDCP_SCORE_TRACE" not in os.environ.get("PEERDCP_NVCC_EXTRA", ""):
        raise SystemExit("set PEERDCP_NVCC_EXTRA=-DPEERDCP_SCORE_TRACE")
    from bench.common import run_ranks

    cfg = {"rows": a.rows, "contexts": a.contexts, "heads": a.heads, "world": a.world, "calls": a.calls, "csv": a.csv}
    cfg["profile"] = a.profile
    cfg["tune"] = {} if a.npage is None else {"cuda_scan_npage": a.npage}
    if a.min_ctas is not None:
        cfg["tune"]["cuda_scan_min_ctas"] = a.min_ctas
    lines = run_ranks("scripts.diag.scan_timeline:rank_main", 1, cfg)[0]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
