"""Run functions on W rank processes (one per GPU, or CPU processes over host memory).

:class:`RankPool` spawns W processes once, initialises ``torch.distributed`` in each (gloo on CPU;
``cpu:gloo,cuda:nccl`` with one GPU per rank), then runs any number of picklable functions on every
rank and returns the per-rank results. Tests and ``peerdcp run`` use it; a hung rank becomes a
``RankError`` after ``timeout``, never a hung caller.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Placement", "RankPool", "RankError", "SAFE_MULTI_GPU_ENV", "placement"]

# Multicast/NVLS is never used by peerdcp and is forbidden on the shared lent machines.
SAFE_MULTI_GPU_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclass(frozen=True)
class Placement:
    """Where a demo's W ranks run: ``world`` ranks, on GPUs (``on_gpu``; ``shared``: ranks share ``gpus`` GPUs) or
    CPU processes over host memory; the process group's ``backend`` and a line saying ``where``."""

    world: int
    gpus: int
    on_gpu: bool
    shared: bool
    backend: str
    where: str

    @property
    def timed(self) -> bool:
        """One GPU per rank: timings measure something (ranks sharing a GPU measure its scheduler; the
        interpreter measures Python)."""
        return self.on_gpu and not self.shared


def placement(world: int | None) -> Placement:
    """``world`` ranks (None: every GPU when there are two or more, else 2): one per GPU when there are enough GPUs,
    ranks sharing the GPUs where ``PEERDCP_SHARED_GPU=1`` allows it, else CPU processes. NCCL refuses two ranks on
    one GPU, so ranks sharing one talk over gloo."""
    import torch

    from ..memory.probe import SHARED_GPU_ENV, ranks_share_gpus

    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    shared = ranks_share_gpus(world or 2)
    on_gpu = shared or (ngpu >= 2 and (world or ngpu) <= ngpu)
    world = world or (ngpu if on_gpu and not shared else 2)
    backend = "cpu:gloo,cuda:gloo" if shared else "cpu:gloo,cuda:nccl" if on_gpu else "gloo"
    where = f"{world} GPU processes" if on_gpu else f"{world} CPU processes over host shared memory (interpreter)"
    if shared:
        where += f" sharing {ngpu} GPU(s) ({SHARED_GPU_ENV}=1: checked, not timed)"
    return Placement(world, ngpu, on_gpu, shared, backend, where)


class RankError(RuntimeError):
    """A function failed (or timed out) on one or more ranks; carries each rank's traceback."""


def _worker(rank: int, world: int, init_file: str, backend: str, env: dict, inq, outq) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    # W processes that each start one OpenMP thread per core oversubscribe the host W times over, and a small
    # op then waits on descheduled threads at every parallel region: share the cores (as torchrun does), unless
    # OMP_NUM_THREADS says otherwise (applied here: torch may have been imported before `env` was set)
    omp = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(omp) if omp.isdigit() and int(omp) > 0 else max(1, (os.cpu_count() or 1) // world))
    if backend != "gloo" and torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    while True:
        task = inq.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            outq.put((rank, True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            outq.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class RankPool:
    """W worker processes with an initialised process group.

    Args:
        world: number of ranks.
        backend: ``"gloo"`` (CPU; kernels run under ``TRITON_INTERPRET=1``) or ``"cpu:gloo,cuda:nccl"``.
        env: extra environment for the workers.
    """

    def __init__(self, world: int, *, backend: str = "gloo", env: dict[str, str] | None = None):
        self.world = world
        self.backend = backend
        full_env = dict(SAFE_MULTI_GPU_ENV)
        if backend == "gloo":
            full_env["TRITON_INTERPRET"] = "1"
        full_env.update(env or {})
        ctx = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="peerdcp-pg-")
        os.close(fd)
        os.unlink(self._init_file)
        self._inq = [ctx.Queue() for _ in range(world)]
        self._outq = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world, self._init_file, backend, full_env, self._inq[r], self._outq),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return ``[result of rank 0, ..., rank W-1]``."""
        if self.broken:
            raise RankError("this RankPool is broken (an earlier call timed out or was interrupted); create a new one")
        for q in self._inq:
            q.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        try:
            while len(results) + len(errors) < self.world:
                rank, ok, value = self._outq.get(timeout=timeout)
                (results if ok else errors)[rank] = value
        except BaseException as e:
            # Timed out, or interrupted while waiting (Ctrl-C, a test's time limit raised from a signal handler):
            # the ranks may still be running this call, and their results would be read as the next call's.
            self.broken = True
            self.close(force=True)
            if isinstance(e, queue.Empty):
                missing = sorted(set(range(self.world)) - set(results) - set(errors))
                raise RankError(f"{fn.__name__}: ranks {missing} did not finish within {timeout:g} s") from None
            raise
        if errors:
            text = "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(errors.items()))
            raise RankError(f"{fn.__name__} failed on ranks {sorted(errors)}:\n{text}")
        return [results[r] for r in range(self.world)]

    def close(self, force: bool = False) -> None:
        for q, p in zip(self._inq, self._procs):
            if p.is_alive() and not force:
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if force else 30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        try:
            os.unlink(self._init_file)
        except FileNotFoundError:
            pass

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
