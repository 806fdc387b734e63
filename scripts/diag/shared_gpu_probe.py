"""What works when W ranks share one GPU (``PEERDCP_SHARED_GPU=1``): a diagnosis for running the multi-GPU
correctness suites on a machine with fewer GPUs than ranks.

For W in --worlds, in W processes on GPU 0 (rank r on GPU r % count): the torch.distributed collectives the
baselines use under ``cpu:gloo,cuda:nccl`` and ``cpu:gloo,cuda:gloo`` (ok or the error), the probe's verdict
per memory kind, a write/read of every peer's slot over vmm and symm, and the signal round trip (µs per round:
the ranks' processes time-slice the GPU, so this is the scheduler's slice, not a link's latency).

    python3 scripts/diag/shared_gpu_probe.py [--worlds 2 4 8] [--rounds 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

SHARED = {"PEERDCP_SHARED_GPU": "1"}


def _err(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def _try(res: dict, name: str, fn) -> None:
    try:
        fn()
        torch.cuda.synchronize()
        res[name] = "ok"
    except Exception as e:  # noqa: BLE001 - reported
        res[name] = _err(e)


def collectives() -> dict:
    import torch.distributed as dist

    W, r = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    res: dict = {"device": str(dev)}
    x = torch.full((W * 4,), float(r), device=dev)
    _try(res, "barrier", lambda: dist.barrier())
    _try(res, "all_reduce", lambda: dist.all_reduce(x.clone()))
    _try(res, "all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(W * W * 4, device=dev), x))
    _try(res, "all_to_all_single", lambda: dist.all_to_all_single(torch.empty_like(x), x))
    _try(res, "reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(4, device=dev), x))
    return res


def memory(rounds: int) -> dict:
    import rankfns_memory as fns

    import peerdcp

    W = torch.distributed.get_world_size()
    caps = peerdcp.memory.probe(device=torch.cuda.current_device())
    res: dict = {k: (caps.eligible(k), caps.kinds[k].reasons[:3]) for k in ("vmm", "symm")}
    for kind in ("vmm", "symm"):
        if not caps.eligible(kind):
            continue
        try:
            res[f"{kind} write_read"] = fns.write_read_all(4 * 2 * 4096 + 16, kind, "cuda")
        except Exception as e:  # noqa: BLE001
            res[f"{kind} write_read"] = _err(e)
    if caps.eligible("vmm"):
        from peerdcp.memory.selftest import expected_pattern, roundtrip, roundtrip_nbytes

        with peerdcp.memory.allocate(roundtrip_nbytes(W, 1000), memory="vmm", device="cuda") as buf:
            ok = True
            t0 = time.perf_counter()
            for e in range(1, rounds + 1):
                out = roundtrip(buf, e, 1000, timeout_s=30.0).cpu()
                ok &= all(torch.equal(out[s], expected_pattern(s, buf.rank, e, 1000)) for s in range(W))
            res["roundtrip"] = {"ok": ok, "us_per_round": (time.perf_counter() - t0) / rounds * 1e6}
    return res


def main() -> None:
    from peerdcp.launch import RankPool

    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    print("gpus", torch.cuda.device_count(), "torch", torch.__version__)
    for W in a.worlds:
        for backend in ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:gloo"):
            if W > 2 and backend.endswith("nccl"):
                continue
            t0 = time.perf_counter()
            with RankPool(W, backend=backend, env=SHARED) as pool:
                try:
                    print(f"W={W} {backend} collectives:", pool.run(collectives, timeout=120)[0])
                except Exception as e:  # noqa: BLE001
                    print(f"W={W} {backend} collectives failed: {str(e)[:600]}")
                if backend.endswith("gloo"):
                    try:
                        for r, m in enumerate(pool.run(memory, a.rounds, timeout=300)):
                            print(f"W={W} rank {r} memory:", m)
                    except Exception as e:  # noqa: BLE001
                        print(f"W={W} memory failed: {str(e)[:1500]}")
            print(f"W={W} {backend}: {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
