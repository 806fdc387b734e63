"""The local Top-K selection's time per CTAs-per-row choice, to check ``ops.select_ctas``'s rule: a diagnosis on one
GPU, not a benchmark.

    python3 scripts/diag/select_ctas_sweep.py [--lengths 8192 16384 32768] [--rows 8 16 24 32 48 64] [--ctas 1 2 4 8]

For every (local scores, rows): µs per ``ops.select`` call (top 2048, CUDA graph of 20 calls, median of 50 replays)
with each forced C (``TUNING["select_ctas"]``; ``-`` where rows clusters of C do not all fit at once, which the rule
never picks), the rule's C and whether the rule picked the fastest C (``best``). Every forced C's keys are checked
equal to C = 1's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.diag.merge_scaling import _time  # noqa: E402 - µs per call, CUDA graph of 20 calls, 50 replays


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768], help="local scores per row")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 24, 32, 48, 64])
    ap.add_argument("--ctas", type=int, nargs="+", default=[1, 2, 4, 8])
    from bench.common import run_ranks

    run_ranks("scripts.diag.select_ctas_sweep:rank_main", 1, vars(ap.parse_args()))  # one GPU, its own group


def rank_main(args: dict) -> None:
    from peerdcp.topk import ops

    a = argparse.Namespace(**args)
    dev = torch.device("cuda", torch.cuda.current_device())
    K = 2048
    print("| local | rows | " + " | ".join(f"C={c}" for c in a.ctas) + " | rule | best | same |")
    print("|" + "---:|" * (len(a.ctas) + 5), flush=True)
    for L in a.lengths:
        for T in a.rows:
            gen = torch.Generator(device=dev).manual_seed(L + T)
            logits = [torch.randn(T, L, generator=gen, device=dev) for _ in range(2)]
            lens = torch.full((T,), 2 * L, dtype=torch.int64, device=dev)  # rank 0 of 2 owns L of them
            outs = [torch.empty(T, K, dtype=torch.int64, device=dev) for _ in range(2)]
            kw = dict(rank=0, world_size=2, interleave=1, force_first=0, force_last=0)
            times, keys = {}, {}
            for c in a.ctas:
                if c > 1 and ops.max_select_clusters(c, dev.index) < T:
                    continue
                with mock.patch.dict(ops.TUNING, {"select_ctas": c}):
                    ops.select(outs[0], logits[0], lens, **kw)
                    keys[c] = outs[0].clone()
                    times[c] = _time(lambda i: ops.select(outs[i % 2], logits[i % 2], lens, **kw))
            rule = ops.select_ctas(T, dev.index, L)
            same = all(torch.equal(k, keys[min(keys)]) for k in keys.values())
            cells = [f"{times[c]:.2f}" if c in times else "-" for c in a.ctas]
            best = min(times, key=times.get)
            print(f"| {L} | {T} | " + " | ".join(cells) + f" | {rule} | {best} | {same} |", flush=True)


if __name__ == "__main__":
    main()
