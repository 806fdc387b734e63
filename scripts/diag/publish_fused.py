"""The direct Top-K's stage 1 + publish on ONE GPU: the publish inside the selection kernel against the selection
followed by the publish kernel (the path of ``TopK.merge`` called on its own).

    python3 scripts/diag/publish_fused.py OUT_DIR [--worlds 2 4] [--rows 1 8 32 128 512] [--lengths 16384 65536]

Rank 0 of a faked W-rank group: every rank's buffer (flags, inbox: TopK's layout) lies on this GPU, so the
publish's peer stores are local stores here (NVLink stores on the real path) and nothing waits for them. Variants
(µs per call: CUDA graph of 20 calls per replay, median of 50 replays): ``select`` - ``ops.select`` alone;
``select+publish`` - ``ops.select`` then ``kernels._publish_kernel`` (TopK.merge's first kernel); ``fused`` -
``ops.select`` with ``publish=``; ``saved`` = select+publish - fused; ``same`` - the fused call's keys, inbox,
flags and epochs equal the two-kernel path's (after the same number of calls). ``--exchange`` adds rank 0's whole
exchange with the merge (``_exchange``: ``x_two`` / ``x_fused`` / ``x_pdl``). A diagnosis tool, not a claim:
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
    ap.add_argument("--exchange", action="store_true", help="also time rank 0's whole exchange (x_* columns)")
    a = ap.parse_args()
    from bench.common import run_ranks

    rows = run_ranks("scripts.diag.publish_fused:rank_main", 1, vars(a))[0]  # one GPU, its own process group
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "publish_fused.json").write_text(json.dumps(rows, indent=1))
    from bench.common import format_table

    cols = ["W", "local_len", "rows", "select", "select+publish", "fused", "saved", "same"]
    if a.exchange:
        cols += ["x_two", "x_fused", "x_pdl", "x_same"]
    print(format_table(rows, cols))


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
                paths = {}
                for path in ("two", "fused"):
                    inbox, bufs, peers = _fake_buffers(W, T, dev)
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
                if a.exchange:
                    row.update(_exchange(W, T, logits, lens, nsets, dev))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def _fake_buffers(W: int, T: int, dev: torch.device) -> tuple[int, list, torch.Tensor]:
    """Every rank's direct-Top-K buffer for T rows, all on this GPU (TopK's layout), zeroed: (the inbox's word
    offset, the buffers, their base addresses as ``peer_ptrs``)."""
    from peerdcp.topk.selector import buffer_layout

    inbox, words = buffer_layout(W, T, K)
    bufs = [torch.zeros(words, dtype=torch.int64, device=dev) for _ in range(W)]
    return inbox, bufs, torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=dev)


def _exchange(W: int, T: int, logits: list, lens: torch.Tensor, nsets: int, dev: torch.device) -> dict:
    """Rank 0's whole direct exchange per call, after the fake peers 1..W-1 published their lists into its
    inbox (a publish kernel each, first on the stream, so rank 0's merge never waits): ``x_two`` - selection,
    publish kernel, merge (``TopK.merge``'s path); ``x_fused`` - the publishing selection, merge;
    ``x_pdl`` - the same with the merge launched with PDL (``TopK.select``'s default). ``x_same``: every variant's
    ids equal the top-k of all W lists."""
    from peerdcp.kernel_support import ErrorWord, mechanism_code
    from peerdcp.topk import ops
    from peerdcp.topk.kernels import _publish_kernel

    assert ops.max_keys(dev.index) >= W * K  # also opts the merge kernel in to the shared memory it needs
    inbox, bufs, peers = _fake_buffers(W, T, dev)
    states = [torch.zeros(1 + T, dtype=torch.int64, device=dev) for _ in range(W)]  # every call advances each once
    err = ErrorWord(dev, 10.0)
    base = dict(interleave=1, force_first=0, force_last=0)
    peer_keys = []  # the fake peers' candidate lists (their own tokens of other scores)
    for d in range(1, W):
        x = torch.randn(T, logits[0].shape[1], generator=torch.Generator(device=dev).manual_seed(d), device=dev)
        keys = torch.empty(T, K, dtype=torch.int64, device=dev)
        ops.select(keys, x, lens, rank=d, world_size=W, **base)
        peer_keys.append(keys)
    own = [torch.empty(T, K, dtype=torch.int64, device=dev) for _ in range(nsets)]
    outs = [torch.empty(T, K, dtype=torch.int32, device=dev) for _ in range(nsets)]

    def publish(keys: torch.Tensor, rank: int) -> None:
        _publish_kernel[(T,)](
            keys, keys.stride(0), K, keys, peers, states[rank], rank, T, inbox,
            W=W, K=K, BLOCK=1024, FILL=False, GPU=True,
        )  # fmt: skip

    def call(i: int, fused: bool, pdl: bool) -> None:
        for d in range(1, W):
            publish(peer_keys[d - 1], d)
        keys = own[i % nsets]
        if fused:
            pub = ops.Publish(peers, states[0], inbox, K, T)
            ops.select(keys, logits[i % nsets], lens, rank=0, world_size=W, publish=pub, **base)
        else:
            ops.select(keys, logits[i % nsets], lens, rank=0, world_size=W, **base)
            publish(keys, 0)
        ops.merge(
            outs[i % nsets], own=keys.data_ptr(), own_stride=K, own_len=K, lists=bufs[0].data_ptr() + 8 * inbox,
            slot_stride=W * T * K, list_stride=T * K, row_stride=K, list_len=K, flags=bufs[0].data_ptr(),
            state=states[0].data_ptr(), err=err.kernel_arg(), timeout_ns=int(10e9), rank=0, world_size=W,
            topk=K, max_rows=T, mech=mechanism_code("topk"), direct=True, pdl=pdl,
        )  # fmt: skip

    res, same = {}, True
    for name, fused, pdl in (("x_two", False, False), ("x_fused", True, False), ("x_pdl", True, True)):
        for i in range(nsets):
            outs[i].fill_(12345)
            call(i, fused, pdl)
            every = torch.cat([own[i]] + peer_keys, dim=1)
            want = (0x7FFFFFFF - (torch.topk(every, K, dim=1).values & 0x7FFFFFFF)).int()
            same &= bool(torch.equal(outs[i], want))
        res[name] = _time(lambda i, fused=fused, pdl=pdl: call(i, fused, pdl))
    err.raise_if_set()
    res["x_same"] = same
    return res


if __name__ == "__main__":
    main()
