"""Process-group helpers: resolving groups, gloo twins, and all-or-nothing agreement."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch.distributed as dist

from .errors import PeerSetupError

__all__ = ["GroupInfo", "resolve_group", "agree", "all_gather_object", "register_cpu_group"]

_GLOO_TWINS: dict[int, dist.ProcessGroup] = {}


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


def resolve_group(group: dist.ProcessGroup | None) -> GroupInfo:
    """Resolve ``group`` (None = default group) and find or create its gloo twin.

    Creating the twin uses ``new_group(..., use_local_synchronization=True)``, so only the group's
    members take part (a DCP group is usually a subset of the world).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("peerdcp needs an initialized torch.distributed process group (init_process_group)")
    pg = group if group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(pg))
    rank = dist.get_rank(pg)
    if rank < 0:
        raise ValueError("this process is not a member of the given group")
    backend = _backend_name(pg)
    if "gloo" in backend and "nccl" not in backend:
        cpu = pg
    elif "gloo" in backend and "nccl" in backend:  # "cpu:gloo,cuda:nccl" handles both
        cpu = pg
    else:
        key = id(pg)
        cpu = _GLOO_TWINS.get(key)
        if cpu is None:
            cpu = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
            _GLOO_TWINS[key] = cpu
    return GroupInfo(pg, cpu, rank, len(ranks), ranks)


def register_cpu_group(group: dist.ProcessGroup, cpu_group: dist.ProcessGroup) -> None:
    """Use ``cpu_group`` (gloo, same ranks) as the twin of ``group`` instead of creating one: a serving
    engine that already owns a gloo twin (SGLang's ``GroupCoordinator.cpu_group``) passes it here."""
    _GLOO_TWINS.setdefault(id(group), cpu_group)


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


def hostname() -> str:
    return socket.gethostname()
