"""The :class:`~peerdcp.topk.TopK` constructor's argument checks and the direct protocol's buffer geometry."""

from __future__ import annotations

from .._runtime.checks import is_int, timeout_problem
from ..memory import MEMORY_KINDS
from .candidates import MAX_TOPK, MERGE_IMPLS
from .policy import TopKPolicy

__all__ = ["BACKENDS", "buffer_layout", "check_args"]

BACKENDS = ("auto", "direct", "allgather")


def check_args(max_rows, topk, backend, memory, interleave, timeout_s, merge_impl, policy) -> None:
    """Raise the TypeError / ValueError a bad ``TopK`` argument gets (the caller agrees it with every rank)."""
    if not is_int(max_rows):
        raise TypeError(f"TopK: max_rows must be an int, got {type(max_rows).__name__}")
    if max_rows < 1:
        raise ValueError(f"TopK: max_rows must be >= 1, got {max_rows}")
    if not is_int(topk):
        raise TypeError(f"TopK: topk must be an int, got {type(topk).__name__}")
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"TopK: topk must be in [1, {MAX_TOPK}], got {topk}")
    if backend not in BACKENDS:
        raise ValueError(f"TopK: backend must be one of {BACKENDS}, got {backend!r}")
    if memory not in MEMORY_KINDS:
        raise ValueError(f"TopK: memory must be one of {MEMORY_KINDS}, got {memory!r}")
    if not is_int(interleave):
        raise TypeError(f"TopK: interleave must be an int, got {type(interleave).__name__}")
    if interleave < 1:
        raise ValueError(f"TopK: interleave must be >= 1, got {interleave}")
    bad_timeout = timeout_problem(timeout_s)
    if bad_timeout:
        raise ValueError(f"TopK: {bad_timeout}")
    if merge_impl not in MERGE_IMPLS:
        raise ValueError(f"TopK: merge_impl must be one of {MERGE_IMPLS}, got {merge_impl!r}")
    if policy is not None and not isinstance(policy, TopKPolicy):
        raise TypeError(f"TopK: policy must be a TopKPolicy or None, got {type(policy).__name__}")


def buffer_layout(W: int, max_rows: int, topk: int) -> tuple[int, int]:
    """The direct protocol's per-rank buffer: (word offset of the inbox ``int64 [2, W, max_rows, topk]``, total
    int64 words). Flags ``int64 [2, W, max_rows]`` first, the inbox 256-byte aligned after them."""
    inbox = -(-2 * W * max_rows // 32) * 32
    return inbox, inbox + 2 * W * max_rows * topk
