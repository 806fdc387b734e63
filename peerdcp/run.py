"""``peerdcp run``: the main job (placeholder until the mechanisms land: probe + peer round trip)."""

from __future__ import annotations

import argparse

import torch


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", type=int, default=None, help="ranks (default: GPUs present, else 2 CPU processes)")
    p.add_argument("--json", default=None, help="write the report as JSON to this path")


def _roundtrip_rank() -> dict:
    import peerdcp
    from peerdcp.memory.selftest import expected_pattern, roundtrip, roundtrip_nbytes

    W = torch.distributed.get_world_size()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with peerdcp.memory.allocate(roundtrip_nbytes(W, 64), device=dev) as buf:
        out = roundtrip(buf, 1, 64).cpu()
        ok = all(torch.equal(out[s], expected_pattern(s, buf.rank, 1, 64)) for s in range(W))
        return {"rank": buf.rank, "memory": buf.memory, "ok": ok}


def main_run(args: argparse.Namespace) -> int:
    from .launch import RankPool

    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = args.world or (ngpu if ngpu >= 2 else 2)
    backend = "cpu:gloo,cuda:nccl" if ngpu >= 2 else "gloo"
    with RankPool(world, backend=backend) as pool:
        res = pool.run(_roundtrip_rank)
    for r in res:
        print(f"rank {r['rank']}: memory={r['memory']} peer round trip {'OK' if r['ok'] else 'FAILED'}")
    return 0 if all(r["ok"] for r in res) else 1
