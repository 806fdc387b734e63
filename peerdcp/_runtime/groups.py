"""Process-group helpers: resolving groups, gloo twins, and all-or-nothing agreement."""

from __future__ import annotations

import socket
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PeerSetupError, PeerTimeoutError

__all__ = [
    "GroupInfo",
    "resolve_group",
    "agree",
    "agree_args",
    "agree_or_release",
    "all_gather_object",
    "bounded_collective",
    "register_cpu_group",
]

# group -> the gloo twin a serving engine registered for it (register_cpu_group); weakly keyed, so a destroyed group's
# entry goes with it (keyed by id(), a later group could take a dead one's id and be handed its twin, with other ranks)
_GLOO_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# global ranks (in group order) -> the gloo twin peerdcp created for them, shared by every group of those ranks. One
# per rank list, for the process's life: torch keeps a group (its sockets and threads) until it is destroyed, and a
# twin per group leaked 5 fds and 2 threads with every group a program created and destroyed. Twins are not
# destroyed either: new_group(use_local_synchronization=True) names a group by its ranks and the count of groups,
# which repeats after destroys, and a new group under a destroyed one's name reads its stale addresses from the store
# (connection refused) or, while that one lives, is refused ("already created"). A twin carries set-up and teardown
# steps, which every rank runs in the same program order (a rank blocks in each), and the calls of the Output / Query
# collective backends on CPU tensors of a non-gloo group: objects on two groups of the same ranks, called from
# different threads, would interleave on it (a group per thread needs its own ranks' gloo group: register_cpu_group).
_OWN_TWINS: dict[tuple[int, ...], dist.ProcessGroup] = {}


@dataclass(frozen=True)
class GroupInfo:
    """A resolved group: the caller's group, a CPU-capable (gloo) twin, this rank and the size."""

    group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    rank: int
    world_size: int
    global_ranks: tuple[int, ...]


def _backend_name(group: dist.ProcessGroup) -> str:
    try:
        return str(dist.get_backend(group)).lower()
    except Exception:  # noqa: BLE001 - some wrappers have no backend name
        return ""


def resolve_group(group: dist.ProcessGroup | None, arg_error: BaseException | None = None) -> GroupInfo:
    """Resolve ``group`` (None = default group) and find or create its gloo twin.

    Creating the twin uses ``new_group(..., use_local_synchronization=True)``, so only the group's members take
    part (a DCP group is usually a subset of the world); groups of the same ranks share it. ``arg_error``: the
    caller's own argument error, raised instead where there is no usable group to agree over (see
    :func:`agree_args`).
    """
    if not dist.is_available() or not dist.is_initialized():
        if arg_error is not None:
            raise arg_error
        raise ValueError("peerdcp needs an initialized torch.distributed process group (init_process_group)")
    pg = group if group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(pg))
    rank = dist.get_rank(pg)
    if rank < 0:
        if arg_error is not None:
            raise arg_error
        raise ValueError("this process is not a member of the given group")
    backend = _backend_name(pg)
    if "gloo" in backend and "nccl" not in backend:
        cpu = pg
    elif "gloo" in backend and "nccl" in backend:  # "cpu:gloo,cuda:nccl" handles both
        cpu = pg
    else:
        cpu = _GLOO_TWINS.get(pg)
        if cpu is None:
            cpu = _OWN_TWINS.get(ranks)
            if cpu is None or not _registered(cpu):  # (destroy_process_group() of the world took it)
                cpu = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
                _OWN_TWINS[ranks] = cpu
    return GroupInfo(pg, cpu, rank, len(ranks), ranks)


def _registered(pg: dist.ProcessGroup) -> bool:
    """Whether torch still has ``pg`` (``destroy_process_group()`` of the world removes every group)."""
    try:
        return dist.distributed_c10d._world.pg_map.get(pg) is not None
    except AttributeError:  # (a torch without this private table: trust the twin)
        return True


def register_cpu_group(group: dist.ProcessGroup, cpu_group: dist.ProcessGroup) -> None:
    """Use ``cpu_group`` (gloo, same ranks) as the twin of ``group`` instead of creating one: a serving
    engine that already owns a gloo twin (SGLang's ``GroupCoordinator.cpu_group``) passes it here."""
    _GLOO_TWINS.setdefault(group, cpu_group)


def all_gather_object(info: GroupInfo, obj: object) -> list:
    out: list = [None] * info.world_size
    dist.all_gather_object(out, obj, group=info.cpu_group)
    return out


def agree(info: GroupInfo, error: BaseException | str | None, what: str) -> None:
    """All-or-nothing step: raise :class:`PeerSetupError` on every rank if any rank reports an error."""
    msg = None if error is None else (error if isinstance(error, str) else f"{type(error).__name__}: {error}")
    msgs = all_gather_object(info, msg)
    bad = [(r, m) for r, m in enumerate(msgs) if m is not None]
    if bad:
        detail = "; ".join(f"rank {r}: {m}" for r, m in bad)
        raise PeerSetupError(f"{what} failed on {len(bad)} of {info.world_size} ranks: {detail}")


def agree_args(info: GroupInfo, error: BaseException | None, what: str) -> None:
    """Argument checks, all or nothing: the rank whose own check failed raises that error (a ValueError or
    TypeError, as if alone); every other rank raises :class:`PeerSetupError` naming it, instead of waiting for it in
    the next collective step until the process group's timeout."""
    msgs = all_gather_object(info, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    bad = [(r, m) for r, m in enumerate(msgs) if m is not None]
    if bad:
        raise PeerSetupError(f"{what}: bad arguments on " + "; ".join(f"rank {r}: {m}" for r, m in bad))


def agree_or_release(info: GroupInfo, error: BaseException | None, what: str, buf) -> None:
    """All or nothing for the local steps that follow a collective allocation (device and pinned memory, launchers):
    a step that fails on one rank only (out of memory, say) must not leave the other ranks with an object whose
    every call times out and whose ``close()`` waits for the failed rank. Every rank reports; if any failed, every
    rank closes ``buf`` (collective: all of them are here) and raises :class:`PeerSetupError` naming the failed ranks
    (chained to the error on the rank where it happened), as an allocation failure does. ``buf`` None: nothing to
    close (a collective backend's set-up), the agreement alone."""
    try:
        agree(info, error, what)
    except PeerSetupError as e:
        try:
            if buf is not None:
                buf.close()
        finally:
            raise e from error


def bounded_collective(
    op: Callable[..., Any],
    out: Any,
    inp: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    timeout_s: float,
    rank: int,
    mechanism: str,
) -> None:
    """``op(out, inp, group=group)``, a torch.distributed collective (all-gather, all-to-all, reduce-scatter; ``out`` a
    tensor or a list of them), with a bound on the host's wait where the host waits anyway.

    CPU tensors (gloo runs the collective on the host: the caller blocks until it ends): started with ``async_op``
    and waited for at most ``timeout_s`` seconds; one that has not completed by then raises
    :class:`~peerdcp.PeerTimeoutError` with ``peer = -1`` (a collective does not say which rank is missing). That
    collective stays pending on the group: the missing rank's matching call completes it; until then the group
    must carry no other collective (destroy it, or let that rank call). An error of the collective itself that comes
    sooner (a peer's process died: connection closed) is raised as torch raises it. torch 2.13's gloo reduce-scatter
    work ignores the wait's bound (and never reports completion): it waits as gloo does, up to the group's timeout
    (the Output ``ag_rs`` backend's all-gather before it is bounded, so a peer missing from a call is caught there).

    Device tensors: ``op`` as it is (NCCL queues it on the stream, capturable in a CUDA graph; the host does not wait
    for it, so a missing peer ends in the process group's own timeout, as in any NCCL program).
    """
    if inp.device.type != "cpu":
        op(out, inp, group=group)
        return
    start = time.monotonic()
    work = op(out, inp, group=group, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        # (the base Work raises "Operation timed out!" and leaves the work pending; an error of the collective
        # itself completes it, except for reduce-scatter works, which never report completion: hence the clock)
        if work.is_completed() or time.monotonic() - start < timeout_s:
            raise
        raise PeerTimeoutError(rank, -1, mechanism, -1, timeout_s) from e


def hostname() -> str:
    return socket.gethostname()
