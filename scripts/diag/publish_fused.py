"""The direct Top-K's stage 1 + publish on ONE GPU: the publish inside the selection kernel against the selection
followed by the publish kernel (what ``TopK.select`` launched before session 26).

    python3 scripts/diag/publish_fused.py OUT_DIR [--worlds 2 4] [--rows 1 8 32 128 512] [--lengths 16384 65536]

Rank 0 of a faked W-rank group: every rank's buffer (flags, inbox: TopK's layout) lies on this GPU, so the
publish's peer stores are local stores here (NVLink stores on the real path) and nothing waits for them. Variants
(µs per call: CUDA graph of 20 calls per replay, median of 50 replays): ``select`` - ``ops.select`` alone;
``select+publish`` - ``ops.select`` then ``kernels._publish_kernel`` (TopK.merge's first kernel); ``fused`` -
``ops.select`` with ``publish=``; ``saved`` = select+publish - fused; ``same`` - the fused call's keys, inbox,
flags and epochs equal the two-kernel path's (after the same number of calls). A diagnosis tool, not a claim:
bench/topk times the whole exchange on W GPUs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.diag.merge_scaling import _time  # noqa: E402 - µs per call, CUDA graph of 20 calls, 50 replays

K = 2048


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536], help="local scores per row")
    a = ap.parse_args()
    from bench.common import run_ranks

    rows = run_ranks("scripts.diag.publish_fused:rank_main", 1, vars(a))[0]  # one GPU, its own process group
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "publish_fused.json").write_text(json.dumps(rows, indent=1))
    from bench.common import format_table

    print(format_table(rows, ["W", "local_len", "rows", "select", "select+publish", "fused", "saved", "same"]))


def rank_main(args: dict) -> list[dict]:
    from peerdcp.topk import ops
    from peerdcp.topk.kernels import _publish_kernel

    a = argparse.Namespace(**args)
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for W in a.worlds:
        for Lloc in a.lengths:
            for T in a.rows:
                if T * Lloc * 4 > (1 << 30):
                    continue
                gen = torch.Generator(device=dev).manual_seed(W + Lloc + T)
                nsets = 2
                logits = [torch.randn(T, Lloc, generator=gen, device=dev) for _ in range(nsets)]
                lens = torch.full((T,), Lloc * W, dtype=torch.int64, device=dev)  # rank 0 owns Lloc of them
                inbox = -(-2 * W * T // 32) * 32
                paths = {}
                for path in ("two", "fused"):
                    bufs = [torch.zeros(inbox + 2 * W * T * K, dtype=torch.int64, device=dev) for _ in range(W)]
                    peers = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=dev)
                    state = torch.zeros(1 + T, dtype=torch.int64, device=dev)
                    outs = [torch.empty(T, K, dtype=torch.int64, device=dev) for _ in range(nsets)]
                    paths[path] = (bufs, peers, state, outs)
                args_ = dict(rank=0, world_size=W, interleave=1, force_first=0, force_last=0)

                def select(i: int, path: str = "two") -> None:
                    _, _, _, outs = paths[path]
                    ops.select(outs[i % nsets], logits[i % nsets], lens, **args_)

                def two(i: int) -> None:
                    _, peers, state, outs = paths["two"]
                    out = outs[i % nsets]
                    ops.select(out, logits[i % nsets], lens, **args_)
                    _publish_kernel[(T,)](
                        out, out.stride(0), K, out, peers, state, 0, T, inbox,
                        W=W, K=K, BLOCK=1024, FILL=False, GPU=True,
                    )  # fmt: skip

                def fused(i: int) -> None:
                    _, peers, state, outs = paths["fused"]
                    ops.select(
                        outs[i % nsets],
                        logits[i % nsets],
                        lens,
                        **args_,
                        publish=ops.Publish(peers, state, inbox, K, T),
                    )

                row = {"W": W, "local_len": Lloc, "rows": T}
                row["select"] = _time(select)
                row["select+publish"] = _time(two)
                row["fused"] = _time(fused)
                row["saved"] = row["select+publish"] - row["fused"]
                # the same number of calls on both paths (time_op makes the same calls for each), then compare
                torch.cuda.synchronize()
                (b2, _, s2, o2), (bf, _, sf, of) = paths["two"], paths["fused"]
                same = torch.equal(s2, sf) and all(torch.equal(x, y) for x, y in zip(b2, bf))
                row["same"] = same and all(torch.equal(x, y) for x, y in zip(o2, of))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
