"""The allocator layer: one :class:`PeerBuffer` API over CUDA VMM, PyTorch symmetric memory and host
shared memory.

Lifecycle: ``allocate`` (collective, all-or-nothing, before any CUDA-graph capture) -> views /
``peer_ptrs`` used by kernels -> ``close`` (collective, idempotent). See DESIGN.md section 4.
"""

from __future__ import annotations

import torch

from .._runtime.checks import resolve_device
from .._runtime.groups import GroupInfo, agree, agree_args, all_gather_object, resolve_group
from .buffer import PeerBuffer
from .probe import Capabilities, Check, KindReport, probe

__all__ = ["allocate", "PeerBuffer", "probe", "Capabilities", "Check", "KindReport", "MEMORY_KINDS", "choose_memory"]

MEMORY_KINDS = ("auto", "vmm", "symm", "host")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_pairing(memory: str, device: torch.device) -> None:
    if memory == "host" and device.type == "cuda":
        raise ValueError("memory='host' holds CPU tensors; device must be cpu")
    if memory in ("vmm", "symm") and device.type != "cuda":
        raise ValueError(f"memory={memory!r} needs a CUDA device, got {device}")


def choose_memory(info: GroupInfo, memory: str, device: torch.device) -> tuple[str, str]:
    """Resolve ``memory`` ("auto" or a kind) for tensors on ``device``; collective. Returns (kind, reason).

    Raises ValueError for an impossible pairing (host memory with CUDA tensors or vice versa) and
    PeerSetupError when the requested kind is ineligible on some rank (with the probe's reasons).
    """
    if memory not in MEMORY_KINDS:
        raise ValueError(f"memory must be one of {MEMORY_KINDS}, got {memory!r}")
    _check_pairing(memory, device)
    gpu = device.type == "cuda"
    caps = probe(info.group, device=device.index if gpu else None)
    if memory == "auto":
        kind, reason = caps.auto(gpu=gpu)
    else:
        rep = caps.kinds[memory]
        kind = memory if rep.eligible else None
        reason = f"{memory} requested; " + "; ".join(rep.reasons)
    agree(info, None if kind else reason, f"memory selection ({memory})")
    kinds = all_gather_object(info, kind)
    if len(set(kinds)) != 1:  # cannot happen after agree on identical facts; keep the guarantee explicit
        agree(info, f"ranks chose different memory kinds {kinds}", "memory selection")
    return kind, reason


def allocate(
    nbytes: int,
    group=None,
    *,
    memory: str = "auto",
    device: torch.device | str | int | None = None,
    _fault: tuple[int, str] | None = None,
) -> PeerBuffer:
    """Collectively allocate ``nbytes`` of peer-visible memory on every rank of ``group``.

    Args:
        nbytes: bytes per rank (> 0).
        group: a ``torch.distributed`` ProcessGroup, or None for the default group. Handles and agreement
            go over a gloo twin when it is an NCCL group.
        memory: ``"auto"`` (vmm, then symm for CUDA; host for CPU), ``"vmm"``, ``"symm"`` or ``"host"``.
        device: the CUDA device (default: current) or ``"cpu"`` for host memory. Default: CUDA if present.
        _fault: tests only: ``(rank, stage)`` makes that rank fail at that stage of host allocation.

    Returns:
        A :class:`PeerBuffer`; zero-filled on every rank before this returns.

    Raises:
        ValueError / TypeError: bad arguments on this rank (before anything is allocated).
        PeerSetupError: bad arguments on another rank, or a rank failed later; raised on every rank, nothing left
            allocated.
        RuntimeError: called during CUDA-graph capture.
    """
    if _capturing():  # (no collective may run inside a capture, not even the agreement below)
        raise RuntimeError(
            "peerdcp.memory.allocate() was called during CUDA-graph capture; allocate (and create every "
            "peerdcp object) before capturing"
        )
    # checked on every rank, then agreed: a bad argument on one rank raises there and a PeerSetupError elsewhere,
    # where the ranks used to wait for it in the probe's all-gather until the process group's timeout
    err: BaseException | None = None
    dev = None
    try:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        if memory not in MEMORY_KINDS:
            raise ValueError(f"memory must be one of {MEMORY_KINDS}, got {memory!r}")
        dev = resolve_device(device, cpu=memory == "host")
        _check_pairing(memory, dev)
    except (TypeError, ValueError) as e:
        err = e
    info = resolve_group(group, err)
    agree_args(info, err, "allocate")
    kind, _reason = choose_memory(info, memory, dev)
    fault = _fault[1] if _fault is not None and _fault[0] == info.rank else None
    if kind == "host":
        from .host import allocate_host

        return allocate_host(info, nbytes, fault=fault)
    # the driver calls need the device current; the caller's current device is restored after them
    with torch.cuda.device(dev):
        if kind == "vmm":
            from .vmm import allocate_vmm

            return allocate_vmm(info, nbytes, dev)
        from .symm import allocate_symm

        return allocate_symm(info, nbytes, dev)
