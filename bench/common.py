"""Shared benchmark utilities for ``bench/<mechanism>.py`` (DESIGN.md section 8).

The method every peerdcp benchmark follows:

1. ``run_ranks("bench.<mech>:rank_main", world, *args)`` starts one process per GPU (``cpu:gloo,cuda:nccl``
   group, NVLS/multicast off) and runs the named module-level function on every rank.
2. On each rank, :func:`time_op` times ``step(i)`` (``i`` = call index; pick input set ``i % n_sets`` so
   inputs rotate): ``calls`` back-to-back calls are captured in one CUDA graph (or run eagerly), each
   replay is preceded by a device-side barrier (a 1-element NCCL all-reduce on the stream, so every
   GPU starts the replay at the same moment) and a GPU sleep of ``--lead-us`` (so the host has enqueued the
   replay before its start event runs), and bracketed by CUDA events. Result: this rank's microseconds per
   call, one value per replay.
3. :func:`slowest_rank` all-gathers those lists, takes the **max over ranks per replay** (a collective
   is as slow as its slowest rank), then the median (and p20/p80) over replays.
4. Rank 0 collects rows (dicts), prints :func:`format_table` last, and writes :func:`write_json` and
   :func:`plot_series` into ``--out``. :func:`header` records machine, GPU and versions.

Everything here is mechanism-agnostic; keep it small. Example::

    def rank_main(cfg):                              # module-level, in bench/<mech>.py
        sets = [make_inputs() for _ in range(4)]
        us = time_op(lambda i: op(*sets[i % 4]), graph=True, calls=20, iters=cfg["iters"])
        return slowest_rank(us)                      # Stats(median, p20, p80, n)

    results = run_ranks("bench.mymech:rank_main", 2, cfg)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import math
import os
import platform
import socket
import statistics
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Stats",
    "add_common_args",
    "run_ranks",
    "device_barrier",
    "time_op",
    "slowest_rank",
    "header",
    "format_table",
    "write_json",
    "plot_series",
]


@dataclass(frozen=True)
class Stats:
    """Microseconds per call over replays (after the max over ranks): median, 20th and 80th percentile."""

    median: float
    p20: float
    p80: float
    n: int

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------------------ CLI
def add_common_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--quick`` (a < 90 s run), ``--out DIR`` (JSON + PNG), ``--world W``, ``--iters``, ``--calls``,
    ``--lead-us`` (see :func:`time_op`)."""
    p.add_argument("--quick", action="store_true", help="fewer sizes and replays (finishes in < 90 s on 2 GPUs)")
    p.add_argument("--out", default="out/bench", help="directory for the JSON and PNG (default: out/bench)")
    p.add_argument("--world", type=int, default=None, help="ranks / GPUs (default: 2, or all GPUs if fewer)")
    p.add_argument("--iters", type=int, default=None, help="timed replays per case (default 100; quick: 30)")
    p.add_argument("--calls", type=int, default=None, help="calls per CUDA graph / timed block (default 20)")
    p.add_argument(
        "--lead-us", type=float, default=100.0,
        help="GPU sleep before each timed replay so the host launch is not timed (default 100; 0: off)",
    )  # fmt: skip
    return p


# ------------------------------------------------------------------------------------------ launching
def _call_by_name(target: str, *args: Any, **kwargs: Any) -> Any:
    mod, _, fn = target.partition(":")
    return getattr(importlib.import_module(mod), fn)(*args, **kwargs)


def run_ranks(target: str, world: int | None = None, *args: Any, timeout: float = 600.0, **kwargs: Any) -> list:
    """Run ``module:function`` on ``world`` GPU ranks (one process each) and return the per-rank results.

    The function is named by string so that a benchmark started as ``python -m bench.x`` (whose module
    is ``__main__`` in the parent) is imported by its real name in the children.
    """
    from peerdcp.harness.launch import RankPool

    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world is None:
        world = 1 if ngpu == 1 else 2
    if ngpu < world:
        raise SystemExit(f"this benchmark needs {world} CUDA GPUs, found {ngpu}")
    with RankPool(world, backend="cpu:gloo,cuda:nccl") as pool:
        return pool.run(_call_by_name, target, *args, timeout=timeout, **kwargs)


# ------------------------------------------------------------------------------------------- timing
_BARRIER_BUF: dict[int, torch.Tensor] = {}


def device_barrier(group=None) -> None:
    """Align the GPUs of ``group`` on the current stream: a 1-element NCCL all-reduce (no host sync)."""
    import torch.distributed as dist

    dev = torch.cuda.current_device()
    t = _BARRIER_BUF.get(dev)
    if t is None:
        t = _BARRIER_BUF[dev] = torch.zeros(1, dtype=torch.float32, device="cuda")
    dist.all_reduce(t, group=group)


def warm_gpu(seconds: float = 0.2) -> None:
    """Keep this rank's GPU busy for about ``seconds`` (back-to-back matmuls), so the first timed case does
    not run at idle clocks. time_op's own warm-up is a few dozen calls (well under a millisecond of work);
    on 2026-11-30 the first T of bench.output (T = 1) timed the LL kernel at 6.1 µs where the breakdown run,
    which warms up first, measured 3.95 µs. No-op without CUDA."""
    if not torch.cuda.is_available():
        return
    import time

    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def time_op(
    step: Callable[[int], Any],
    *,
    graph: bool = True,
    calls: int = 20,
    iters: int = 100,
    warmup: int = 3,
    group=None,
    lead_us: float = 100.0,
) -> list[float]:
    """This rank's µs per call of ``step``, one value per timed replay (``iters`` values).

    Args:
        step: ``step(i)`` runs call number ``i`` (0 <= i < calls); use ``i`` to rotate inputs. It must be
            capturable when ``graph`` is True (no host sync, no allocation outside the graph pool).
        graph: capture ``calls`` calls in one CUDA graph and replay it; else run them eagerly.
        calls: back-to-back calls per replay (the per-call time is the replay time / calls).
        iters: timed replays. ``warmup``: untimed replays first (eager warm-up also runs before capture).
        group: the process group used for the device barrier before each replay (NCCL).
        lead_us: after the barrier, every rank's stream first sleeps about this long on the GPU
            (``torch.cuda._sleep``, same length on every rank, so they stay aligned), so that the host has
            enqueued the start event, the replay and the end event before the start event runs. Without
            it, a replay whose GPU work is shorter than its host-side launch (the NCCL barrier, two events
            and the graph launch: tens of µs) is timed with the host's launch gap inside: 2026-11-30, the
            LL kernel at T = 1 (10 calls, ~40 µs of GPU work) measured bimodal 4 / 6-7 µs per call. 0 turns
            it off (the old harness).

    Every rank must call this with the same arguments (the barrier is collective).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("time_op needs an initialised process group (use run_ranks)")

    def block() -> None:
        for i in range(calls):
            step(i)

    # eager warm-up: JIT compiles, NCCL communicators, caches (required before capture)
    for _ in range(2):
        block()
    torch.cuda.synchronize()
    run = block
    g = None
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            block()  # one more eager pass on the capture stream (recommended before capture)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        dist.barrier(group=group)
        with torch.cuda.graph(g):
            block()
        torch.cuda.synchronize()
        run = g.replay
    lead_cycles = _sleep_cycles(lead_us)
    for _ in range(warmup):
        device_barrier(group)
        run()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for k in range(iters):
        device_barrier(group)
        if lead_cycles:
            torch.cuda._sleep(lead_cycles)
        starts[k].record()
        run()
        ends[k].record()
    torch.cuda.synchronize()
    out = [s.elapsed_time(e) * 1000.0 / calls for s, e in zip(starts, ends)]
    del g
    return out


def _sleep_cycles(us: float) -> int:
    """GPU clock cycles of ``torch.cuda._sleep`` for about ``us`` µs at this device's clock (0 for us <= 0)."""
    if us <= 0:
        return 0
    khz = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 0)  # kHz
    return int(us * (khz if khz > 0 else 1_980_000) / 1000.0)  # (H200 boost clock if not reported)


def slowest_rank(times_us: Sequence[float], group=None) -> Stats:
    """Max over ranks per replay, then median / p20 / p80 over replays (collective over ``group``)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, list(times_us), group=group)
    n = min(len(t) for t in gathered)
    worst = sorted(max(t[i] for t in gathered) for i in range(n))
    if not worst:
        return Stats(float("nan"), float("nan"), float("nan"), 0)

    def pct(q: float) -> float:
        return worst[min(len(worst) - 1, max(0, round(q * (len(worst) - 1))))]

    return Stats(statistics.median(worst), pct(0.2), pct(0.8), n)


# ------------------------------------------------------------------------------------------ reporting
def _git_sha() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True)
        sha = out.stdout.strip()
        return (sha + ("+dirty" if dirty.stdout.strip() else "")) if sha else "unknown"
    except OSError:
        return "unknown"


def header() -> dict:
    """Machine, GPU and versions for the JSON and RESULTS.md (call in the parent or on rank 0)."""
    import triton

    h: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git": _git_sha(),
    }
    if torch.cuda.is_available():
        h["gpu"] = torch.cuda.get_device_name(0)
        h["gpus"] = torch.cuda.device_count()
        h["cuda"] = torch.version.cuda
        try:
            h["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - optional
            pass
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
            )
            h["driver"] = smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else "unknown"
        except OSError:
            pass
    try:
        from importlib.metadata import version

        h["sglang"] = version("sglang")
    except Exception:  # noqa: BLE001 - not installed
        h["sglang"] = None
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        h[k] = os.environ.get(k)
    return h


def format_table(rows: Sequence[dict], columns: Sequence[str], *, floatfmt: str = "{:.2f}") -> str:
    """A plain fixed-width text table of ``rows`` (dicts) over ``columns``; missing cells print ``-``."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return floatfmt.format(v)
        return str(v)

    body = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(columns)]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths))
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line, sep, *("  ".join(v.rjust(w) for v, w in zip(b, widths)) for b in body)])


def _standard(x: Any) -> Any:
    """``x`` with every non-finite float (a failed or untimed cell) as None: standard JSON has no NaN/inf."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _standard(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_standard(v) for v in x]
    return x


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    """Write ``payload`` (e.g. ``{"header": header(), "rows": rows}``) as indented standard JSON (NaN and
    infinities become null); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_standard(payload), indent=1, default=str, allow_nan=False) + "\n")
    return p


def plot_series(
    path: str | os.PathLike,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str = "µs per call (median of slowest rank)",
    logx: bool = True,
    logy: bool = False,
) -> Path | None:
    """One line per series ``name -> (xs, ys)`` into a PNG; returns the path (None if matplotlib is absent)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p
