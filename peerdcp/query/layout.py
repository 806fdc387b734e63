"""The direct backend's exposed buffer (one per rank, ``PeerBuffer``): where each region starts, in bytes.

``[0, data_off)`` the flag header (ready[2][NPROG][W] + ack[NPROG][W], int64); slots 0 and 1 (parity; any
exchange) and slot Z (exposed: a raw slot), ``slot_bytes`` each; then the LL area of the CUDA LL / LL12 push
calls, sized for the LL layout (LL12 lines need 2/3 of it) of ``ll_area`` tokens:
``[2 parity][W src][ll_area][H][2 * D * out-size]``; then the LL128 area ``[2 parity][W src][ll128_lines][128]``;
then the sentinel area of the SN push calls ``[2 parity][W src][sn_max][H][D]`` out-dtype rows. Every region
starts on a 256-byte boundary. See ``kernels.py`` (module docstring) for what the slots hold.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DirectLayout", "direct_layout", "header_bytes", "push_region_bytes"]


def push_region_bytes(max_tokens: int, heads: int, head_dim: int, out_size: int) -> int:
    """Bytes of one source's region in a push slot: finished rows ``[max_tokens, H, D]`` of the out dtype."""
    return max_tokens * heads * head_dim * out_size


def header_bytes(nprog: int, world: int) -> int:
    """Bytes of the flag header (ready[2][NPROG][W] + ack[NPROG][W], int64), rounded up to 4 KiB."""
    return -(-(3 * nprog * world * 8) // 4096) * 4096


def _up256(n: int) -> int:
    return -(-n // 256) * 256


@dataclass(frozen=True)
class DirectLayout:
    """Byte offsets of the exposed buffer's regions (see the module docstring) and its total size."""

    data_off: int
    slot_bytes: int
    ll_off: int
    ll128_off: int
    sn_off: int
    sn_bytes: int  # the sentinel area (filled with its rest state, 0xFF, at construction)
    total: int


def direct_layout(
    *,
    max_tokens: int,
    heads: int,
    head_dim: int,
    world: int,
    nprog: int,
    out_size: int,
    push_slots: bool,
    ll_area: int,
    ll128_lines: int,
    sn_max: int,
) -> DirectLayout:
    """The layout of an object with these sizes (``out_size``: bytes of an output element; ``push_slots``: slots
    0/1 hold W push regions; ``ll_area`` / ``ll128_lines`` / ``sn_max``: the flag-in-data areas' sizes)."""
    raw_bytes = max_tokens * heads * head_dim * 2
    slot_bytes = raw_bytes
    if push_slots:
        slot_bytes = max(raw_bytes, world * push_region_bytes(max_tokens, heads, head_dim, out_size))
    slot_bytes = _up256(slot_bytes)
    data_off = header_bytes(nprog, world)
    ll_off = _up256(data_off + 2 * slot_bytes + raw_bytes)
    ll128_off = _up256(ll_off + 2 * world * ll_area * heads * 2 * head_dim * out_size)
    sn_off = _up256(ll128_off + 2 * world * ll128_lines * 128)
    sn_bytes = 2 * world * sn_max * heads * head_dim * out_size
    return DirectLayout(data_off, slot_bytes, ll_off, ll128_off, sn_off, sn_bytes, sn_off + sn_bytes)
