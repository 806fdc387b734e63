"""Where an eager ``TopK.select`` call's host time goes: a diagnosis, not a benchmark.

    python3 scripts/diag/topk_eager_profile.py [--world W] [--rows 8] [--context 32768] [--calls 300]

Per rank (W = 2 unless given; on one GPU with ``PEERDCP_SHARED_GPU=1`` the ranks share it and only the host
columns mean anything):
the host time per call of ``TopK.select`` over ``--calls`` back-to-back eager calls (the host never waits for the
GPU), the GPU time per call of the same burst (CUDA events), then the host time of its pieces on their own (the
input checks, ``local_candidates``, ``merge``, the CUDA selection launch, the publish launch, the CUDA merge
launch), then rank 0's ``cProfile`` of the select calls (top functions by own time). Eager only: CUDA graphs run
none of this host code (``bench.topk``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from peerdcp.step import gpu_burst_us  # noqa: E402 - GPU us per call of a back-to-back burst
from scripts.diag.query_eager_profile import _per_call_us as _host_us  # noqa: E402 - host us per call, back to back
from scripts.diag.query_eager_profile import profile_calls  # noqa: E402


def rank_main(T: int, ctx: int, calls: int) -> dict:
    import torch.distributed as dist

    from peerdcp.topk import TopK, ops
    from peerdcp.topk import reference as ref
    from peerdcp.topk.selector import _check_force, _check_lengths_on_host, _check_logits_and_lens

    W, r = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(r)
    L = ref.local_length(ctx, 0, W, 1)
    logits = torch.randn(T, L, device=dev, generator=g)
    lens = torch.full((T,), ctx, dtype=torch.int64, device=dev)
    out = {}
    tk = TopK(None, max_rows=T, topk=2048, backend="direct", device=dev)
    try:
        select = lambda: tk.select(logits, lens)  # noqa: E731
        for _ in range(20):
            select()
        keys = tk.local_candidates(logits, lens)
        res = torch.empty(T, 2048, dtype=torch.int32, device=dev)
        torch.cuda.synchronize()
        dist.barrier()
        out["select_host"] = _host_us(select, calls)
        dist.barrier()
        torch.cuda.synchronize()
        out["select_gpu"] = gpu_burst_us(select, calls)
        dist.barrier()
        out["checks"] = _host_us(
            lambda: (
                tk._ready("select"),
                _check_logits_and_lens("TopK.select", logits, lens, dev),
                _check_force("TopK.select", 0, 0),
                _check_lengths_on_host("TopK.select", lens, L, r, W, 1),
            ),
            calls,
        )
        out["local_candidates"] = _host_us(lambda: tk.local_candidates(logits, lens), calls)
        n = keys.shape[1]
        sel_out = torch.empty(T, n, dtype=torch.int64, device=dev)
        out["select_launch"] = _host_us(
            lambda: ops.select(sel_out, logits, lens, rank=r, world_size=W, interleave=1, force_first=0, force_last=0),
            calls,
        )
        out["alloc_out"] = _host_us(lambda: torch.empty(T, 2048, dtype=torch.int32, device=dev), calls)
        dist.barrier()
        out["merge"] = _host_us(lambda: tk.merge(keys), calls)  # publish + merge: both ranks run it
        dist.barrier()
        out["publish_merge_parts"] = _host_us(lambda: (tk._publish(keys, res), tk._merge_inbox(keys, res)), calls)
        dist.barrier()
        out["profile"] = profile_calls(select, calls, 20)
        out["merge_impl"] = tk.merge_impl
        dist.barrier()
    finally:
        tk.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2, help="ranks")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args()
    from peerdcp.launch import RankPool
    from peerdcp.memory.probe import ranks_share_gpus

    W = a.world
    # PEERDCP_SHARED_GPU=1 with fewer GPUs than ranks: NCCL refuses two ranks on a GPU, gloo does not; the ranks
    # then time-slice the GPU, so only the host columns mean anything
    with RankPool(W, backend="cpu:gloo,cuda:gloo" if ranks_share_gpus(W) else "cpu:gloo,cuda:nccl") as pool:
        res = pool.run(rank_main, a.rows, a.context, a.calls)
    for r, d in enumerate(res):
        vals = "  ".join(f"{k} {v:.1f} us" for k, v in d.items() if isinstance(v, float))
        print(f"rank {r} ({d['merge_impl']} merge): {vals}")
    print(res[0]["profile"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
