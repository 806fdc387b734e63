"""Where an eager Query gather call's host time goes (W = 2 GPUs): a diagnosis, not a benchmark.

    python3 scripts/diag/query_eager_profile.py [--tokens 1] [--heads 32] [--calls 300]

Per rank: the host time per call of ``QueryGather.gather`` (direct CUDA, FP8) and of the allgather(fused) baseline
over ``--calls`` back-to-back eager calls (the host never waits for the GPU: the direct kernel's flow control waits
on the device), then of its pieces on their own (the input checks, the output allocation, the custom-op launch),
then rank 0's ``cProfile`` of the direct calls (top functions by own time). Eager only: with CUDA graphs none of
this runs (``bench.query``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _per_call_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


def profile_calls(fn, calls: int, top: int) -> str:
    """``cProfile`` of ``calls`` calls of ``fn`` (the GPU drained after): the ``top`` functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def rank_main(T: int, H: int, calls: int) -> dict:
    import torch.distributed as dist

    from peerdcp.query import QueryGather
    from peerdcp.query.rope import plain_cos_sin_cache

    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(dist.get_rank())
    q_nope = torch.randn(T, H, 512, device=dev, generator=g).bfloat16()
    q_pe = torch.randn(T, H, 64, device=dev, generator=g).bfloat16()
    pos = torch.randint(0, 4096, (T,), device=dev, generator=g)
    cs = plain_cos_sin_cache(4096, 64, device=dev)
    out = {}
    qg = QueryGather(None, max_tokens=max(T, 8), heads_per_rank=H, backend="direct", impl="cuda")
    base = QueryGather(None, max_tokens=max(T, 8), heads_per_rank=H, backend="allgather")
    try:
        direct = lambda: qg.gather(q_nope, q_pe, pos, cs)  # noqa: E731
        ag = lambda: base.gather(q_nope, q_pe, pos, cs)  # noqa: E731
        for f in (direct, ag):
            for _ in range(20):
                f()
        torch.cuda.synchronize()
        dist.barrier()
        out["direct"] = _per_call_us(direct, calls)
        dist.barrier()
        out["allgather_fused"] = _per_call_us(ag, calls)
        dist.barrier()
        # the pieces (local, no exchange)
        out["checks"] = _per_call_us(
            lambda: (
                qg._ready(),
                qg._check_shard("q_nope", q_nope, 512),
                qg._check_shard("q_pe", q_pe, 64),
                qg._check_common(T, pos, cs, None),
            ),
            calls,
        )
        out["alloc_out"] = _per_call_us(lambda: qg._new_out(T, None), calls)
        out["copy_mode"] = _per_call_us(lambda: qg._copy_mode(T), calls)
        out["ready"] = _per_call_us(qg._ready, calls)
        dist.barrier()
        out["profile"] = profile_calls(direct, calls, 18)
        dist.barrier()
    finally:
        qg.close()
        base.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args()
    from peerdcp.launch import RankPool
    from peerdcp.memory.probe import ranks_share_gpus

    # PEERDCP_SHARED_GPU=1 on one GPU: NCCL refuses two ranks on a GPU, gloo does not (host columns only)
    with RankPool(2, backend="cpu:gloo,cuda:gloo" if ranks_share_gpus(2) else "cpu:gloo,cuda:nccl") as pool:
        res = pool.run(rank_main, a.tokens, a.heads, a.calls)
    for r, d in enumerate(res):
        print(f"rank {r}: " + "  ".join(f"{k} {v:.1f} us" for k, v in d.items() if k != "profile"))
    print(res[0]["profile"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
