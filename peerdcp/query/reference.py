"""The Query gather in plain torch: the specification every kernel is checked against.

Each rank r of a DCP group of W ranks holds, for the T query tokens of a decode step, its own H heads:

* ``q_nope [T, H, nope]`` bf16 - the absorbed MLA query (``q_nope @ W_UK``), passed through;
* ``q_pe [T, H, rope]`` bf16 - the rotary part, **not yet rotated**.

Attention over the local KV shard needs the *widened* query of all W*H heads, rank-major (widened head
``s*H + h`` is head h of rank s), with RoPE applied and converted to the attention kernel's dtype::

    q [T, W*H (or padded), nope + rope]   nope first, then the rotated part
    q[t, s*H + h, :nope]  = cvt(q_nope_s[t, h, :] * quant_scale)
    q[t, s*H + h, nope:]  = cvt(rope(q_pe_s[t, h, :], cos_sin_cache[positions[t]]) * quant_scale)
    q[t, W*H:, :]         = 0   (padding heads, for FlashMLA's 64 / 128)

``cvt`` is a saturating round-to-nearest-even cast to FP8 ``float8_e4m3fn`` (clamp to +-448 first: torch's
eager cast does not saturate), or a round-to-nearest-even cast to bf16 (then ``quant_scale`` must be 1).

RoPE (``cos_sin_cache [max_pos, rope]`` fp32, row ``[cos_0 .. cos_{d/2-1} | sin_0 .. sin_{d/2-1}]``):

* ``interleaved`` (GPT-J pairs 2i, 2i+1; MLA of DeepSeek/Kimi/GLM):
  ``y[2i] = x[2i]*c_i - x[2i+1]*s_i``, ``y[2i+1] = x[2i]*s_i + x[2i+1]*c_i``
* ``neox`` (pairs i, i+d/2; the DeepSeek-V3.2 indexer):
  ``y[i] = x[i]*c_i - x[i+d/2]*s_i``, ``y[i+d/2] = x[i]*s_i + x[i+d/2]*c_i``

Rounding contract (why the kernels are byte-identical to :func:`widened_query` in fp32): every product and
sum is rounded to fp32 separately, in exactly the order written above (two products, then one add or
subtract, then the ``quant_scale`` product). The Triton kernels are launched with ``enable_fp_fusion=False``
and the CUDA kernel uses ``__fmul_rn``/``__fadd_rn``, so no fused multiply-add changes a rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "FP8_MAX",
    "ROPE_STYLES",
    "apply_rope",
    "convert_out",
    "quantize_fp8",
    "rope_query_rows",
    "widened_query",
    "widened_query_bounds",
    "rope_quantize_kv",
]

FP8_MAX = 448.0
ROPE_STYLES = ("interleaved", "neox")


def _pairs(x: torch.Tensor, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated pairs' first and second elements, ``[..., rope / 2]`` each."""
    d = x.shape[-1]
    return (x[..., 0::2], x[..., 1::2]) if style == "interleaved" else (x[..., : d // 2], x[..., d // 2 :])


def _join(y0: torch.Tensor, y1: torch.Tensor, style: str) -> torch.Tensor:
    """Inverse of :func:`_pairs`."""
    return torch.stack((y0, y1), dim=-1).flatten(-2) if style == "interleaved" else torch.cat((y0, y1), dim=-1)


def _check_rope(x: torch.Tensor, cos_sin: torch.Tensor, style: str) -> None:
    if style not in ROPE_STYLES:
        raise ValueError(f"rope style must be one of {ROPE_STYLES}, got {style!r}")
    d = x.shape[-1]
    if d % 2 or cos_sin.shape[-1] != d:
        raise ValueError(f"rope dim must be even and match cos_sin_cache ({cos_sin.shape[-1]}), got {d}")


def apply_rope(
    x: torch.Tensor, cos_sin: torch.Tensor, style: str, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Rotate ``x [..., rope]`` by ``cos_sin [..., rope]`` (rows ``[cos | sin]``, broadcastable); in ``dtype``.

    Returns ``[..., rope]`` in ``dtype`` (fp32 for the kernels' contract, fp64 for an exact-math check).
    """
    _check_rope(x, cos_sin, style)
    d = x.shape[-1]
    x0, x1 = _pairs(x.to(dtype), style)
    cos, sin = cos_sin.to(dtype)[..., : d // 2], cos_sin.to(dtype)[..., d // 2 :]
    return _join(x0 * cos - x1 * sin, x0 * sin + x1 * cos, style)


def quantize_fp8(x: torch.Tensor, quant_scale: float = 1.0) -> torch.Tensor:
    """Saturating round-to-nearest-even ``float8_e4m3fn`` of ``x * quant_scale`` (multiply in x's dtype).

    NaN stays NaN; +-inf and every magnitude above 448 become +-448.
    """
    y = x * quant_scale if quant_scale != 1.0 else x
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def convert_out(x: torch.Tensor, out_dtype: torch.dtype, quant_scale: float = 1.0) -> torch.Tensor:
    """The output conversion: FP8 (``quant_scale`` applied, saturating) or bf16 (``quant_scale`` must be 1)."""
    if out_dtype == torch.float8_e4m3fn:
        return quantize_fp8(x, quant_scale)
    if out_dtype == torch.bfloat16:
        if quant_scale != 1.0:
            raise ValueError(f"quant_scale applies to FP8 output only; got {quant_scale} with bfloat16 output")
        return x.to(torch.bfloat16)
    raise TypeError(f"out_dtype must be torch.float8_e4m3fn or torch.bfloat16, got {out_dtype}")


def _table_rows(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """``[T, 1, rope]``: each position's row of the table. A position outside the table's rows takes the nearest
    row, as the kernels do (clamped, never an index error)."""
    return cos_sin_cache[positions.long().clamp(0, cos_sin_cache.shape[0] - 1)].unsqueeze(1)


def rope_query_rows(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    rope_style: str = "interleaved",
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    quant_scale: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One rank's heads: ``q_nope [T, H, nope]``, ``q_pe [T, H, rope]`` -> ``[T, H, nope + rope]`` in ``out_dtype``.

    ``compute_dtype`` fp32 is the kernels' exact contract; fp64 is the "true math" the tests bound the
    fp32 result against (:func:`widened_query_bounds`).
    """
    cs = _table_rows(positions, cos_sin_cache)
    pe = apply_rope(q_pe, cs, rope_style, dtype=compute_dtype)
    full = torch.cat((q_nope.to(compute_dtype), pe), dim=-1)
    return convert_out(full, out_dtype, quant_scale)


def widened_query(
    q_nopes: Sequence[torch.Tensor],
    q_pes: Sequence[torch.Tensor],
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    rope_style: str = "interleaved",
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    quant_scale: float = 1.0,
    pad_heads_to: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The widened query from every rank's shard (lists indexed by rank).

    Args:
        q_nopes: W tensors ``[T, H, nope]`` bf16, rank-major.
        q_pes: W tensors ``[T, H, rope]`` bf16, un-rotated.
        positions: ``[T]`` int, rows of ``cos_sin_cache``.
        cos_sin_cache: ``[max_pos, rope]`` fp32, rows ``[cos | sin]``.
        pad_heads_to: None, or a head count >= W*H; heads ``[W*H, pad)`` are zero.

    Returns:
        ``[T, max(W*H, pad_heads_to), nope + rope]`` in ``out_dtype``.
    """
    rows = [
        rope_query_rows(
            n,
            p,
            positions,
            cos_sin_cache,
            rope_style=rope_style,
            out_dtype=out_dtype,
            quant_scale=quant_scale,
            compute_dtype=compute_dtype,
        )
        for n, p in zip(q_nopes, q_pes)
    ]
    return _pad_heads(torch.cat(rows, dim=1), pad_heads_to)


def _pad_heads(q: torch.Tensor, pad_heads_to: int | None) -> torch.Tensor:
    """``q [T, heads, D]`` with zero heads appended up to ``pad_heads_to``."""
    if pad_heads_to is not None and pad_heads_to > q.shape[1]:
        pad = torch.zeros((q.shape[0], pad_heads_to - q.shape[1], q.shape[2]), dtype=q.dtype, device=q.device)
        q = torch.cat((q, pad), dim=1)
    return q


_U32 = 2.0**-24  # fp32 unit roundoff (round to nearest)
_TINY32 = 2.0**-146  # a few fp32 subnormal steps: the absolute error an underflowing rounding may add


def _rounding_error(v: torch.Tensor) -> torch.Tensor:
    """Bound on ``|fl32(v) - v|`` for exact fp64 ``v``: 0 where ``v`` is an fp32 value."""
    return torch.where(v.float().double() == v, 0.0, _U32 * v.abs() + _TINY32)


def _rope_with_error(x: torch.Tensor, cos_sin: torch.Tensor, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The true rotation of bf16 ``x`` (fp64; each product of a bf16 and an fp32 value is exact there) and a
    bound on the fp32 contract's error for each element: its two rounded products, then the rounded sum,
    which is exact only when both products are and one of them is 0 (position 0: ``c = 1, s = 0``)."""
    _check_rope(x, cos_sin, style)
    d = x.shape[-1]
    x0, x1 = _pairs(x.double(), style)
    cos, sin = cos_sin.double()[..., : d // 2], cos_sin.double()[..., d // 2 :]
    ys, errs = [], []
    for a, b, sign in ((x0 * cos, x1 * sin, -1.0), (x0 * sin, x1 * cos, 1.0)):
        y, e = a + sign * b, _rounding_error(a) + _rounding_error(b)
        exact = (e == 0) & ((a == 0) | (b == 0))
        ys.append(y)
        errs.append(torch.where(exact, 0.0, e + _U32 * (y.abs() + e) + _TINY32))
    return _join(*ys, style), _join(*errs, style)


def widened_query_bounds(
    q_nopes: Sequence[torch.Tensor],
    q_pes: Sequence[torch.Tensor],
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    rope_style: str = "interleaved",
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    quant_scale: float = 1.0,
    pad_heads_to: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise ``(lo, hi)`` in ``out_dtype``: the outputs any computation following the rounding
    contract (module docstring) can give, bracketed from the true (fp64) math. Same arguments and shape as
    :func:`widened_query`; a result ``q`` is right when ``lo <= q <= hi`` in value order.

    Error model, ``u = 2**-24``: every fp32 rounding of a value ``v`` errs by at most ``u*|v|`` (0 when ``v``
    is an fp32 value); a rotated element ``y = fl(fl(x0*c) - fl(x1*s))`` therefore errs by at most
    ``e = e0 + e1 + u*(|y*| + e0 + e1)``, ``e0``/``e1`` its products' errors and ``y*`` the true value. That is
    proportional to ``|x0*c| + |x1*s|``, not to ``|y*|``, which cancellation can make far smaller: no fixed
    number of output steps from the fp64 value bounds the contract. The ``quant_scale`` product adds
    ``u*|scale*y|``, or nothing for a power-of-two scale (exact). The result lies in ``[scale*y* - E,
    scale*y* + E]``; fp32 rounding and the output cast are monotone, so the cast of both ends (through fp32,
    as the contract casts) brackets the output. Non-finite values get ``E = 0`` (their result is +-inf or
    saturated, exactly).
    """
    cs = _table_rows(positions, cos_sin_cache)
    mant, _ = torch.frexp(torch.tensor(float(quant_scale), dtype=torch.float64))
    scale_exact = bool(mant.abs() == 0.5)  # a power of two
    lo, hi = [], []
    for n, p in zip(q_nopes, q_pes):
        y, e_pe = _rope_with_error(p, cs, rope_style)
        true = torch.cat((n.double(), y), dim=-1)
        err = torch.cat((torch.zeros_like(n, dtype=torch.float64), e_pe), dim=-1)
        if not scale_exact:
            err = err + _U32 * (true.abs() + err) + _TINY32
        true, err = true * quant_scale, err * quant_scale
        err = torch.where(err.isfinite(), err, torch.zeros_like(err))
        lo.append(convert_out((true - err).float(), out_dtype))
        hi.append(convert_out((true + err).float(), out_dtype))
    return _pad_heads(torch.cat(lo, dim=1), pad_heads_to), _pad_heads(torch.cat(hi, dim=1), pad_heads_to)


def rope_quantize_kv(
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    rope_style: str = "interleaved",
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    kv_quant_scale: float = 1.0,
) -> torch.Tensor:
    """This rank's own KV-cache entry for the same tokens: ``k_nope [T, nope]`` (the latent ``c_kv``) and
    un-rotated ``k_pe [T, rope]`` -> ``[T, nope + rope]`` (the FP8 MLA cache layout: 512 nope, then 64 rope).

    SGLang's fused FP8 path (``mla_rope_quantize_fp8``) does this in the same kernel as the query, with
    ``kv_quant_scale = 1 / k_scale``. Same math and rounding as the query rows.
    """
    return rope_query_rows(
        k_nope.unsqueeze(1),
        k_pe.unsqueeze(1),
        positions,
        cos_sin_cache,
        rope_style=rope_style,
        out_dtype=out_dtype,
        quant_scale=kv_quant_scale,
    ).squeeze(1)
