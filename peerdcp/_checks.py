"""Argument helpers shared by every public class: integer checks and device resolution."""

from __future__ import annotations

import torch

__all__ = ["is_int", "resolve_device"]


def is_int(x: object) -> bool:
    """True for Python ints (bools excluded)."""
    return isinstance(x, int) and not isinstance(x, bool)


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
    dev = torch.device("cuda", device) if is_int(device) else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"{owner}device must be a CUDA device or cpu, got {dev}")
    return dev
