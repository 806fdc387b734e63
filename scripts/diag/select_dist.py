"""The CUDA local Top-K selection's time by score distribution (one GPU): a diagnosis, not a benchmark.

    python3 scripts/diag/select_dist.py [--lengths 2048 4096 16384 65536] [--rows 1 32 128]

``bucket_top`` (csrc/topk_select.cu) spreads 2048 buckets evenly over the gathered keys' score range and falls back to
a radix trim and a network sort when a bucket holding one of the n largest keys holds more than 32 keys. Normal
scores (``bench.topk --local``) never do; heavy-tailed ones - such as ``bench.topk`` part 2's own indexer scores over
random FP8 keys with power-of-two scales from 2^-9 to 2^-4 - can. This times ``_local_keys`` (top 2048, one rank,
the library's CTA rule) per distribution: ``normal``, ``indexer`` (``Σ_h w_h · ReLU(q_h · k_s) · scale_s`` with
``bench.topk``'s random queries, weights and keys, 64 heads), ``lognormal``; µs per call (a CUDA graph of 20 calls,
median of 21 replays), keys checked equal to the torch path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def scores(kind: str, T: int, L: int, gen: torch.Generator) -> torch.Tensor:
    from bench.topk import _random_keys

    dev = torch.device("cuda")
    if kind == "normal":
        return torch.randn(T, L, generator=gen, device=dev)
    if kind == "lognormal":
        return torch.randn(T, L, generator=gen, device=dev).exp()
    H = 64
    k8, ks = _random_keys(L, gen, dev)
    q = (torch.randn(T, H, 128, generator=gen, device=dev) * 2).to(torch.float8_e4m3fn).float()
    w = torch.randn(T, H, generator=gen, device=dev) * H**-0.5 * 128**-0.5
    dots = torch.einsum("thd,sd->ths", q, k8.float()).clamp_min(0)
    return ((dots * w[:, :, None]).sum(1) * ks[None, :]).contiguous()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096, 16384, 65536])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 32, 128])
    ap.add_argument("--kinds", nargs="+", default=["normal", "indexer", "lognormal"])
    a = ap.parse_args()
    from peerdcp.topk import ops
    from peerdcp.topk.selector import _local_keys

    print("| local scores | rows | " + " | ".join(a.kinds) + " |")
    print("|---:|---:|" + "---:|" * len(a.kinds))
    for L in a.lengths:
        for T in a.rows:
            cells = []
            for kind in a.kinds:
                gen = torch.Generator(device="cuda").manual_seed(L * 7 + T)
                x = scores(kind, T, L, gen)
                lens = torch.full((T,), L, dtype=torch.int64, device="cuda")

                def fn(x=x, lens=lens):
                    return _local_keys(x, lens, 2048, 0, 1, 1, 0, 0)

                with mock.patch.dict(ops.TUNING, {"local_select": "torch"}):
                    want = fn()
                same = torch.equal(fn(), want)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        fn()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(20):
                        fn()
                times = []
                for _ in range(21):
                    torch.cuda._sleep(200_000)  # the host enqueues the events and the replay before they run
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    graph.replay()
                    e.record()
                    torch.cuda.synchronize()
                    times.append(s.elapsed_time(e) * 1e3 / 20)
                cells.append(f"{statistics.median(times):.2f}{'' if same else ' (DIFFERS)'}")
            print(f"| {L} | {T} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
