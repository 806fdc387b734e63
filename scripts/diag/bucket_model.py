"""A numpy model of ``bucket_top``'s overflow rule (csrc/topk_select.cu), on CPU: how often a row's gathered keys
send the selection to its trim + network-sort fallback, per score distribution and map.

    python3 scripts/diag/bucket_model.py [--lengths 2048 4096] [--rows 200]

``bucket_top`` puts the gathered keys (every key of a row of <= 4096 local scores) into 2048 buckets over their
range, descending, and falls back when a bucket holding one of the n = 2048 largest holds more than ``kMaxBucket``
keys (bucket 0: 256). Maps: ``score`` (even widths in score, the kernel's first choice) and ``bits`` (even widths in
the ordered 32-bit score - about the log of |score|; the kernel's map when the scores' range is not finite).
Prints the fallback rate for kMaxBucket 32 and 128, with the score map alone and with a retry by the bits map (the
kernel's rule: 128 and the retry, ``bucket_top<true>``). ``indexer``:
``bench.topk`` part 2's scores (random FP8 key bytes, power-of-two scales, 64 heads). A model of the rule, not of the
kernel's time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BINS, N, TOP = 2048, 2048, 256


def ordered(x: np.ndarray) -> np.ndarray:
    """``reference.ordered_bits`` of the scores as fp32 (int64, the kernel's 32-bit score parts)."""
    import torch

    from peerdcp.topk.reference import ordered_bits

    return ordered_bits(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).numpy()


def buckets(v: np.ndarray, lo=None, hi=None) -> np.ndarray:
    """The kernel's ``BucketMap`` in numpy: each value's bucket among BINS evenly spaced over [lo, hi] (default
    [v.min(), v.max()]; values outside go to the end buckets), descending (0: the largest). Float v: the score map;
    integer v (ordered bits): the bits map, whose width counts hi - lo + 1 values as the kernel's does."""
    lo = v.min() if lo is None else lo
    hi = v.max() if hi is None else hi
    width = max(hi - lo + (1 if v.dtype.kind == "i" else 0), np.finfo(np.float64).tiny) / BINS
    return (
        BINS - 1 - np.clip((v - lo) / width, 0, BINS - 1).astype(np.int64)
    )  # (clamped before the cast, as the kernel)


def overflows(v: np.ndarray, kmax: int) -> bool:
    """v: the mapped values, descending. True when a bucket of the N largest holds more than kmax (bucket 0: TOP)."""
    if v[0] == v[-1]:
        return True
    b = buckets(v)
    sizes = np.bincount(b, minlength=BINS)
    rel = np.unique(b[: min(N, len(v))])
    other = sizes[rel[rel != 0]]
    return bool(sizes[0] > TOP or (other.size and other.max() > kmax))


def indexer_scores(L: int, gen) -> np.ndarray:
    """One row of ``bench.topk`` part 2's indexer scores (``bench.topk._local_scores``)."""
    import torch

    from bench.topk import _local_scores

    return _local_scores("indexer", 1, L, gen, torch.device("cpu"))[0].numpy()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096])
    ap.add_argument("--rows", type=int, default=200, help="rows per distribution (indexer: a quarter)")
    a = ap.parse_args()
    import torch

    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    dists = {
        "normal": lambda L: rng.standard_normal(L),
        "indexer": lambda L: indexer_scores(L, gen),
        "lognormal s=1": lambda L: rng.lognormal(size=L),
        "lognormal s=2": lambda L: rng.lognormal(sigma=2, size=L),
        "student t3": lambda L: rng.standard_t(3, size=L),
        "cauchy": lambda L: rng.standard_t(1, size=L),
        "pareto a=1": lambda L: rng.pareto(1, size=L),
    }
    print("| keys | scores | score map, 32 | + bits retry, 32 | score map, 128 | + bits retry, 128 |")
    print("|---:|---|---:|---:|---:|---:|")
    for L in a.lengths:
        for name, f in dists.items():
            rows = max(1, a.rows // 4) if name == "indexer" else a.rows
            hits = np.zeros(4)
            for _ in range(rows):
                x = np.sort(f(L).astype(np.float32))[::-1]
                s32, s128 = overflows(x.astype(np.float64), 32), overflows(x.astype(np.float64), 128)
                o = ordered(x)
                hits += [s32, s32 and overflows(o, 32), s128, s128 and overflows(o, 128)]
            print(f"| {L} | {name} | " + " | ".join(f"{h / rows:.2f}" for h in hits) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
