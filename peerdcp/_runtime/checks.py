"""Argument helpers shared by every public class: integer checks, wait bounds and device resolution."""

from __future__ import annotations

import torch

__all__ = ["is_int", "resolve_device", "timeout_problem", "MAX_TIMEOUT_S"]

#: the longest wait bound an object accepts, in seconds (~11.6 days): the kernels hold it as int64 nanoseconds and
#: as a spin count, and an unbounded value (inf, 1e12) overflowed those after the peer memory was allocated
MAX_TIMEOUT_S = 1e6


def is_int(x: object) -> bool:
    """True for Python ints (bools excluded)."""
    return isinstance(x, int) and not isinstance(x, bool)


def timeout_problem(timeout_s: object) -> str | None:
    """What is wrong with ``timeout_s`` as a bound of peer waits (None: a number in (0, MAX_TIMEOUT_S] seconds)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        return f"timeout_s must be a number of seconds, got {timeout_s!r}"
    if not 0 < timeout_s <= MAX_TIMEOUT_S:  # (NaN fails too)
        return f"timeout_s must be positive and at most {MAX_TIMEOUT_S:g} seconds, got {timeout_s!r}"
    return None


def cuda_index(device: torch.device) -> int:
    """The ordinal of CUDA ``device`` (the current device when it has no index)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def resolve_device(device: torch.device | str | int | None, *, cpu: bool = False, owner: str = "") -> torch.device:
    """The device an object's tensors live on.

    ``None`` means the current CUDA device, or ``cpu`` when there is no CUDA or ``cpu`` is True (host
    memory); an int is a CUDA ordinal; ``"cuda"`` without an index is the current device. Anything but
    a CUDA device or the CPU raises ValueError (``owner`` prefixes the message).
    """
    if device is None:
        if cpu or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())
    try:
        dev = torch.device("cuda", device) if is_int(device) else torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{owner}device must be a CUDA device or cpu, got {device!r} ({e})") from e
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"{owner}device must be a CUDA device or cpu, got {dev}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{owner}device {dev} was asked for, but this process sees no CUDA device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif not 0 <= dev.index < torch.cuda.device_count():
            raise ValueError(f"{owner}device {dev} does not exist ({torch.cuda.device_count()} CUDA devices)")
    return dev
