"""The Output/LSE combine, in plain torch: the specification every kernel is checked against.

DESIGN.md section 3. For one (token, head), source ``i`` (a DCP rank) contributes a partial attention
output ``o_i [D]`` and a log-sum-exp ``l_i`` (fp32, base e or base 2):

1. sanitize: NaN and +inf become -inf (an empty or invalid shard);
2. ``m = max_i l_i``, or 0 when every ``l_i`` is -inf;
3. ``w_i = b^(l_i - m)`` (b = e or 2), ``S = sum_i w_i``;
4. ``out = sum_i (w_i / S) * o_i``, accumulated in fp32 or better, **never reading ``o_i`` when
   ``w_i == 0``** (an empty shard's payload may be stale or NaN; ``0 * NaN`` would poison the row);
5. merged ``lse = m + log_b S``; when every source is empty (S == 0): ``out = 0`` and ``lse = -inf``.

:func:`combine` is that rule on stacked sources; :func:`dcp_reduce` is the whole DCP Output reduce
(each rank's widened ``[T, W*H, D]`` partial -> rank r's own heads ``[T, H, D]``). Both compute in
float64 by default so they are a reference, not an implementation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["LSE_BASES", "normalize_lse_base", "sanitize_lse", "combine", "dcp_reduce", "rank_sources"]

LSE_BASES = ("e", "2")


def normalize_lse_base(lse_base: str | int | float) -> str:
    """``"e"`` or ``"2"`` from ``"e"``, ``"2"``, ``2`` or ``2.0``; ValueError otherwise."""
    if isinstance(lse_base, str) and lse_base in LSE_BASES:
        return lse_base
    if not isinstance(lse_base, (bool, str)) and lse_base == 2:
        return "2"
    raise ValueError(f"lse_base must be 'e' or 2 (natural log or log2 LSE), got {lse_base!r}")


def sanitize_lse(lse: torch.Tensor) -> torch.Tensor:
    """NaN and +inf -> -inf (same dtype); finite values and -inf unchanged."""
    bad = torch.isnan(lse) | (lse == float("inf"))
    return torch.where(bad, torch.full_like(lse, float("-inf")), lse)


def combine(
    outs: torch.Tensor | Sequence[torch.Tensor],
    lses: torch.Tensor | Sequence[torch.Tensor],
    *,
    lse_base: str | int = "e",
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LSE-weighted combine of ``N`` sources.

    Args:
        outs: ``[N, *rows, D]`` (or a sequence of ``N`` tensors ``[*rows, D]``), any float dtype.
        lses: ``[N, *rows]`` (or ``N`` tensors ``[*rows]``), float; NaN / +inf mean "empty".
        lse_base: ``"e"`` (natural log, FlashMLA) or ``2`` (log2, FlashInfer / trtllm).
        return_lse: also return the merged LSE.
        compute_dtype: float64 (default) or float32.

    Returns:
        ``out [*rows, D]`` in ``compute_dtype`` (0 where every source is empty), and with
        ``return_lse`` the merged ``lse [*rows]`` (-inf where every source is empty).
    """
    base = normalize_lse_base(lse_base)
    o = torch.stack(list(outs)) if not isinstance(outs, torch.Tensor) else outs
    l = torch.stack(list(lses)) if not isinstance(lses, torch.Tensor) else lses
    if o.dim() < 2 or l.shape != o.shape[:-1]:
        raise ValueError(f"outs [N, *rows, D] and lses [N, *rows] disagree: {tuple(o.shape)} vs {tuple(l.shape)}")
    l = sanitize_lse(l.to(compute_dtype))
    m = l.max(dim=0).values
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    d = l - m
    w = torch.exp(d) if base == "e" else torch.exp2(d)  # exactly 0 for l == -inf
    s = w.sum(dim=0)
    safe_s = torch.where(s > 0, s, torch.ones_like(s))
    o64 = o.to(compute_dtype)
    # torch.where, not w * o: a zero-weight source's payload (maybe NaN) must not reach the sum.
    contrib = torch.where((w > 0).unsqueeze(-1), (w / safe_s).unsqueeze(-1) * o64, torch.zeros_like(o64))
    out = contrib.sum(dim=0)
    if not return_lse:
        return out
    log_s = torch.log(safe_s) if base == "e" else torch.log2(safe_s)
    lse = torch.where(s > 0, m + log_s, torch.full_like(m, float("-inf")))
    return out, lse


def rank_sources(
    partial_outs: Sequence[torch.Tensor], partial_lses: Sequence[torch.Tensor], rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What rank ``rank`` receives: ``([W, T, H, D], [W, T, H])``, source s = rank s's slice of heads
    ``[rank*H, (rank+1)*H)`` (widened heads are rank-major)."""
    W = len(partial_outs)
    if len(partial_lses) != W or W == 0:
        raise ValueError("need one partial_out and one partial_lse per rank")
    T, WH, D = partial_outs[0].shape
    if WH % W:
        raise ValueError(f"widened heads {WH} are not a multiple of the world size {W}")
    H = WH // W
    sl = slice(rank * H, (rank + 1) * H)
    return (
        torch.stack([p[:, sl, :] for p in partial_outs]),
        torch.stack([p[:, sl] for p in partial_lses]),
    )


def dcp_reduce(
    partial_outs: Sequence[torch.Tensor],
    partial_lses: Sequence[torch.Tensor],
    rank: int,
    *,
    lse_base: str | int = "e",
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The DCP Output reduce for rank ``rank``.

    Args:
        partial_outs: W tensors ``[T, W*H, D]``: rank s's partial attention output for every widened head.
        partial_lses: W tensors ``[T, W*H]`` fp32: rank s's LSE per widened head.
        rank: which rank's result to compute.

    Returns:
        ``out [T, H, D]`` (``compute_dtype``) for heads ``[rank*H, (rank+1)*H)``, and with ``return_lse``
        the merged ``lse [T, H]``.
    """
    o, l = rank_sources(partial_outs, partial_lses, rank)
    return combine(o, l, lse_base=lse_base, return_lse=return_lse, compute_dtype=compute_dtype)
