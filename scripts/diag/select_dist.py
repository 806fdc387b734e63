"""The CUDA local Top-K selection's time by score distribution (one GPU): a diagnosis, not a benchmark.

    python3 scripts/diag/select_dist.py [--lengths 2048 4096 16384 65536] [--rows 1 32 128]

``bucket_top`` (csrc/topk_select.cu) spreads 2048 buckets evenly over the gathered keys' score range; when a bucket
holding one of the n largest keys holds more than kMaxBucket keys it spreads them once more evenly over the keys' bits,
and when that overflows too it falls back to a radix trim and a network sort. Normal scores (``bench.topk --local``)
never overflow; heavy-tailed ones - such as ``bench.topk`` part 2's own indexer scores over random FP8 keys with
power-of-two scales from 2^-9 to 2^-4 - can. This times ``_local_keys`` (top 2048, one rank, the library's CTA rule) per
distribution: ``normal`` and ``indexer`` (``bench.topk._local_scores``), ``lognormal`` (sigma 1), ``cauchy``, ``sinkX``
(normal, local row 0 scored X: one far outlier, always among the estimate's samples); µs per call
(``merge_scaling._time``: CUDA graph of 20 calls, median of 50 replays), keys checked equal to the torch path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.diag.merge_scaling import _time  # noqa: E402 - µs per call, CUDA graph of 20 calls, 50 replays


def scores(kind: str, T: int, L: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    """``[T, L]`` fp32 scores of one distribution."""
    from bench.topk import _local_scores

    if kind == "lognormal":
        return torch.randn(T, L, generator=gen, device=dev).exp()
    if kind == "cauchy":
        return torch.tan(torch.pi * (torch.rand(T, L, generator=gen, device=dev) - 0.5))
    if kind.startswith("sink"):  # normal scores and one far outlier (an attention sink) at local row 0
        x = torch.randn(T, L, generator=gen, device=dev)
        x[:, 0] = float(kind[4:])
        return x
    return _local_scores(kind, T, L, gen, dev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096, 16384, 65536])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 32, 128])
    ap.add_argument("--kinds", nargs="+", default=["normal", "indexer", "lognormal", "cauchy"])
    from bench.common import run_ranks

    run_ranks("scripts.diag.select_dist:rank_main", 1, vars(ap.parse_args()))  # one GPU, its own process group


def rank_main(args: dict) -> None:
    from peerdcp.topk import ops
    from peerdcp.topk.selector import _local_keys

    a = argparse.Namespace(**args)
    dev = torch.device("cuda", torch.cuda.current_device())
    print("| local scores | rows | " + " | ".join(a.kinds) + " |")
    print("|---:|---:|" + "---:|" * len(a.kinds), flush=True)
    for L in a.lengths:
        for T in a.rows:
            cells = []
            for kind in a.kinds:
                x = scores(kind, T, L, torch.Generator(device=dev).manual_seed(L * 7 + T), dev)
                lens = torch.full((T,), L, dtype=torch.int64, device=dev)
                with mock.patch.dict(ops.TUNING, {"local_select": "torch"}):
                    want = _local_keys(x, lens, 2048, 0, 1, 1, 0, 0)
                same = torch.equal(_local_keys(x, lens, 2048, 0, 1, 1, 0, 0), want)
                us = _time(lambda i, x=x, lens=lens: _local_keys(x, lens, 2048, 0, 1, 1, 0, 0))
                cells.append(f"{us:.2f}{'' if same else ' (DIFFERS)'}")
            print(f"| {L} | {T} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
