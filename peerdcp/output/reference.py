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
float64 by default so they are a reference, not an implementation. :func:`combine_bounds` /
:func:`dcp_reduce_bounds` give, per element, the interval an fp32 implementation of the rule lands in (the
tests' check against the fp64 value; its error model is in its docstring).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "LSE_BASES",
    "normalize_lse_base",
    "sanitize_lse",
    "combine",
    "combine_bounds",
    "dcp_reduce",
    "dcp_reduce_bounds",
    "outside_bounds",
    "rank_sources",
]

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
    o, l = _stacked(outs, lses)
    m, _, w, s = _weights(l, base, compute_dtype)
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


def _stacked(outs, lses) -> tuple[torch.Tensor, torch.Tensor]:
    """``(outs [N, *rows, D], lses [N, *rows])`` stacked from tensors or sequences; ValueError if they disagree."""
    o = torch.stack(list(outs)) if not isinstance(outs, torch.Tensor) else outs
    l = torch.stack(list(lses)) if not isinstance(lses, torch.Tensor) else lses
    if o.dim() < 2 or l.shape != o.shape[:-1]:
        raise ValueError(f"outs [N, *rows, D] and lses [N, *rows] disagree: {tuple(o.shape)} vs {tuple(l.shape)}")
    return o, l


def _weights(lses: torch.Tensor, base: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Steps 1-3 in ``dtype``: ``(m [*rows], d = l - m [N, *rows], w [N, *rows], S [*rows])``."""
    l = sanitize_lse(lses.to(dtype))
    m = l.max(dim=0).values
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    d = l - m
    w = torch.exp(d) if base == "e" else torch.exp2(d)  # exactly 0 for l == -inf
    return m, d, w, w.sum(dim=0)


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


# fp32 error model of the combine (see combine_bounds). u: unit roundoff; one ulp of a normal value v is at
# most 2u|v|. The library-function bounds are NVIDIA's published maxima (CUDA Programming Guide, math appendix:
# __expf 2 + floor(1.173|x|) ulp, expf / exp2f 2 ulp, __logf 2^-21.41 absolute on [0.5, 2] and 3 ulp elsewhere,
# logf / log2f 1 ulp, an approximate fp32 division 2 ulp). Triton 3.6's exp / exp2 are ex2.approx (after a
# product with log2(e)) and its fp32 division div.full (2 ulp); its log is libdevice's (read from the kernels'
# PTX and SASS).
_U = 2.0**-24
_TINY = 2.0**-126  # smallest normal fp32: what a flushed or subnormal weight can lose, absolutely
_SUB = 2.0**-149  # one fp32 subnormal step: the absolute error of a rounding that underflows
_EXP_ULPS = (4.0, 3.5)  # relative weight error in u: 4 + 3.5|d| (d in natural-log units), see combine_bounds
_LOG_ABS = 2.0**-21  # the logarithm's absolute error near 1 ...
_LOG_REL = 8.0  # ... and its relative error elsewhere, in u (3 ulp, the ln 2 product, margin for lg2)


def _round_ends(center: torch.Tensor, err: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[center - err, center + err]`` cast to fp32 and then to ``dtype``: roundings to nearest are monotone,
    so any fp32 value in the interval, cast the same way, lies between the two ends."""
    return (center - err).float().to(dtype), (center + err).float().to(dtype)


def combine_bounds(
    outs: torch.Tensor | Sequence[torch.Tensor],
    lses: torch.Tensor | Sequence[torch.Tensor],
    *,
    lse_base: str | int = "e",
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Elementwise ``(out_lo, out_hi, lse_lo, lse_hi)``: what an fp32 implementation of :func:`combine` can
    return, bracketed from the fp64 value. Same arguments as :func:`combine`; ``out_lo`` / ``out_hi``
    ``[*rows, D]`` in ``out_dtype``, ``lse_lo`` / ``lse_hi`` ``[*rows]`` fp32. A result is right when
    ``out_lo <= out <= out_hi`` and ``lse_lo <= lse <= lse_hi`` (both ``0`` / ``-inf`` where every source is
    empty).

    Error model (``u = 2**-24``; ``p_i = w_i / S`` the exact normalized weights, ``d_i = l_i - m`` in natural-log
    units; every implementation takes the maximum first, then the weights, the fp32 sums of ``w_i`` and
    ``w_i * o_i`` over the ``N`` sources, and one normalization):

    * a weight errs relatively by ``(4 + 3.5|d_i|) u``: the rounding of ``l_i - m`` (``|d_i| u``), then the
      exponential (``__expf``: ``2 + 1.173|d_i|`` ulp; ``exp2f`` and the ex2 approximation: 2 ulp, plus the
      ``log2(e)`` product's rounding); a weight below the normal range may lose ``2**-126`` absolutely (flushed);
    * ``S``'s relative error ``eps_S = sum_i p_i eps_w_i + N u`` (``N - 1`` additions);
    * the output ``sum_i p_i o_i`` errs by ``sum_i p_i |o_i| (eps_w_i + eps_S + (2N + 8) u)``: ``2N`` roundings
      of the products and sums (unfused ``w*o + acc`` included; the all-gather + reduce-scatter path rounds
      ``w/S``, the product and ``N - 1`` sums), and ``8 u`` for the normalization (an approximate division's 2
      ulp, or a reciprocal and a product); second-order terms within a factor ``1 + 2**-10``, plus the flushed
      weights and one subnormal step per rounding, absolutely. This is proportional to ``sum_i p_i |o_i|``,
      not to the result, which cancellation can make far smaller: hence no fixed number of output steps;
    * the merged LSE ``m + log_b S`` (``m`` exact): ``log_b`` of ``S(1 + eps_S)`` moves by
      ``eps_S / ln(b)`` (to first order), the logarithm itself errs by ``2**-21 + 8u |log_b S|``; the final
      fp32 addition rounds once (taken by casting the ends).

    The ends are cast through fp32 (monotone roundings), so an interval narrower than one output step is
    one value. Assumes no fp32 overflow (``sum_i w_i |o_i|`` below 3.4e38).
    """
    base = normalize_lse_base(lse_base)
    o, l = _stacked(outs, lses)
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise TypeError(f"out_dtype must be a floating-point torch.dtype, got {out_dtype!r}")
    n = o.shape[0]
    ln_b = 1.0 if base == "e" else math.log(2.0)
    out, lse = combine(o, l, lse_base=base, return_lse=True)
    _, d, w, s = _weights(l, base, torch.float64)
    p = w / torch.where(s > 0, s, torch.ones_like(s))
    live = w > 0
    eps_w = torch.where(live, _U * (_EXP_ULPS[0] + _EXP_ULPS[1] * d.abs() * ln_b), torch.zeros_like(d))
    eps_s = (p * eps_w).sum(dim=0) + n * _U + n * _TINY
    # |o_i| of the sources that count (an empty source's payload may be NaN)
    o_abs = torch.where(live.unsqueeze(-1), o.double().abs(), torch.zeros((), dtype=torch.float64))
    a_i = p.unsqueeze(-1) * o_abs
    a = a_i.sum(dim=0)
    o_live = o_abs.sum(dim=0)
    rel = (a_i * eps_w.unsqueeze(-1)).sum(dim=0) + a * (eps_s + (2 * n + 8) * _U).unsqueeze(-1)
    err = rel * (1 + 2.0**-10) + _TINY * (o_live + n * a) + (2 * n + 8) * _SUB
    empty = (s == 0).unsqueeze(-1)
    err = torch.where(empty, torch.zeros_like(err), err)
    out_lo, out_hi = _round_ends(out, err, out_dtype)
    log_s = torch.log(torch.where(s > 0, s, torch.ones_like(s))) / ln_b
    lse_err = (eps_s / ln_b) * (1 + 2 * eps_s) + _LOG_ABS + _LOG_REL * _U * log_s.abs() * (1 + eps_s)
    lse_err = torch.where(s > 0, lse_err, torch.zeros_like(lse_err))
    lse_lo, lse_hi = _round_ends(lse, lse_err, torch.float32)
    return out_lo, out_hi, lse_lo, lse_hi


def outside_bounds(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Bool mask of the elements of ``x`` that are NaN or outside ``[lo, hi]`` (a :func:`combine_bounds` pair; an
    all-empty row's ``lo == hi`` is 0 or -inf, so only exactly that value is inside). Compared in fp64."""
    v = x.double()
    return (v < lo.double()) | (v > hi.double()) | v.isnan()


def dcp_reduce_bounds(
    partial_outs: Sequence[torch.Tensor],
    partial_lses: Sequence[torch.Tensor],
    rank: int,
    *,
    lse_base: str | int = "e",
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`combine_bounds` for rank ``rank``'s DCP Output reduce (arguments as :func:`dcp_reduce`):
    ``(out_lo, out_hi)`` ``[T, H, D]`` in ``out_dtype``, ``(lse_lo, lse_hi)`` ``[T, H]`` fp32."""
    o, l = rank_sources(partial_outs, partial_lses, rank)
    return combine_bounds(o, l, lse_base=lse_base, out_dtype=out_dtype)
