"""A numpy model of the CUDA selection's threshold estimate (``sample_thresholds`` and the walk in
csrc/topk_select.cu), on CPU: how many gather passes a row of more than 4096 local scores needs, per score
distribution, with the samples bucketed even in score over their whole range, over a range that a few far outliers
do not stretch (the kernel's rule: ``robust_range``), or even in their bits (about log |score|; measured, not the
kernel's), and the crowding flag of the alternative estimates measured beside them.

    python3 scripts/diag/estimate_model.py [--lengths 8192 16384 65536 131072] [--rows 100]

The kernel takes kSamples = 2048 evenly spaced scores of the row (4096 above 64K with one CTA), puts them into 2048
buckets over their range, and takes as threshold f (kFrac = 1, 3, 5, 8, 11, 13, 15) the smallest sample of the bucket
holding rank q_f = want_f · kSamples / nloc − 1, want_f = n + (kBuf − n) · f / 16. It gathers every key at or above
the middle threshold (f = 8) and walks up or down while the count is outside [n, kBuf]; each step is one more pass
over the row, and when the walk turns or runs out the radix select takes over (printed as 9 passes here).
``crowded``: the middle threshold's bucket holds samples of more than (kBuf − n) / 4 of the row's keys. A model of
the rule and the walk, not of the kernel's time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.diag.bucket_model import BINS, buckets, ordered  # noqa: E402 - the kernel's BucketMap, ordered_bits

N, KBUF = 2048, 4096
KFRAC = (1, 3, 5, 8, 11, 13, 15)
RADIX = 9  # printed for a walk that ends in the radix select


def robust_range(xs: np.ndarray) -> tuple[float, float]:
    """The samples' range in the kernel: sample s (kernel order: s = r * 1024 + thread) belongs to
    lane s % 32, 8 groups of 4 lanes; the largest group minimum to the smallest group maximum, or the whole range
    where those cross."""
    lane = np.arange(len(xs)) % 32
    lo_l = np.array([xs[lane == j].min() for j in range(32)])
    hi_l = np.array([xs[lane == j].max() for j in range(32)])
    lo, hi = lo_l.reshape(8, 4).min(1).max(), hi_l.reshape(8, 4).max(1).min()
    return (lo, hi) if lo < hi else (xs.min(), xs.max())


def thresholds(x: np.ndarray, samples: int, mode: str) -> list[tuple[int, int]]:
    """Per threshold f: (samples in its bucket, keys of the row at or above it). mode: ``whole`` (the score map over
    the samples' whole range), ``robust`` (over ``robust_range``, the kernel's) or ``bits`` (over the samples'
    bits). Finite scores only."""
    nloc = len(x)
    xs = x[(np.arange(samples) * nloc) // samples].astype(np.float32)
    o = ordered(xs)
    if mode == "bits":
        b = buckets(o)
    else:
        xd = xs.astype(np.float64)
        b = buckets(xd, *robust_range(xd)) if mode == "robust" else buckets(xd)
    hist = np.bincount(b, minlength=BINS)
    start = np.concatenate([[0], np.cumsum(hist)[:-1]])
    ox = ordered(x.astype(np.float32))
    out = []
    for f in KFRAC:
        q = min(max((N + (KBUF - N) * f // 16) * samples // nloc - 1, 0), samples - 1)
        a = int(np.searchsorted(start, q, side="right") - 1)
        out.append((int(hist[a]), int((ox >= o[b == a].min()).sum())))
    return out


def passes(th: list[tuple[int, int]]) -> int:
    """Gather passes of the kernel's walk from the middle threshold (RADIX: it ends in the radix select)."""
    t, d_prev, p = len(KFRAC) // 2, 0, 1
    while True:
        c = th[t][1]
        d = -1 if c > KBUF else (1 if c < N else 0)
        if d == 0:
            return p
        if d == -d_prev or not 0 <= t + d < len(KFRAC):
            return RADIX
        d_prev, t, p = d, t + d, p + 1


def crowded(th: list[tuple[int, int]], nloc: int, samples: int) -> bool:
    return th[len(KFRAC) // 2][0] * nloc > (KBUF - N) // 4 * samples


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384, 65536, 131072])
    ap.add_argument("--rows", type=int, default=100)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    dists = {
        "normal": lambda L: rng.standard_normal(L),
        "uniform": lambda L: rng.random(L),
        "lognormal s=2": lambda L: rng.lognormal(sigma=2, size=L),
        "student t3": lambda L: rng.standard_t(3, size=L),
        "pareto a=1": lambda L: rng.pareto(1, size=L),
        "cauchy": lambda L: rng.standard_t(1, size=L),
        # normal scores with one far outlier (an attention sink) at local row 0, which the estimate always samples
        "normal, sink 1e3": lambda L: np.concatenate([[1e3], rng.standard_normal(L - 1)]),
        "normal, sink 1e4": lambda L: np.concatenate([[1e4], rng.standard_normal(L - 1)]),
        # a finite mask value (-1e30) where the estimate samples, and a run of 64 sinks: one group of the robust range
        "normal, mask -1e30": lambda L: np.concatenate([[-1e30], rng.standard_normal(L - 1)]),
        "normal, 64 sinks 1e4": lambda L: np.concatenate([np.full(64, 1e4), rng.standard_normal(L - 64)]),
        "sorted": lambda L: np.sort(rng.standard_normal(L)),
    }
    print(
        "| local scores | scores | crowded rows | passes, score map over the whole range (mean / max) | over the robust"
        " range (the kernel) | bits map | bits where crowded |"
    )
    print("|---:|---|---:|---|---|---|---|")
    for L in a.lengths:
        samples = 4096 if L > 65536 else 2048
        for name, f in dists.items():
            flags, ps = [], {"score": [], "robust": [], "bits": [], "rule": []}
            for _ in range(a.rows):
                x = f(L)
                s, b = thresholds(x, samples, "whole"), thresholds(x, samples, "bits")
                flags.append(crowded(s, L, samples))
                ps["score"].append(passes(s))
                ps["robust"].append(passes(thresholds(x, samples, "robust")))
                ps["bits"].append(passes(b))
                ps["rule"].append(passes(b if flags[-1] else s))
            cells = " | ".join(f"{np.mean(v):.2f} / {max(v)}" for v in ps.values())
            print(f"| {L} | {name} | {np.mean(flags):.2f} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
